import random

import pytest

from ae.data.planning.plan import assign_shards, plan_epoch


def _read(plan, rank: int, worker: int) -> list[tuple[int, int]]:
    """(shard, index) pairs a slot reads."""
    return [(s.shard, i) for s in plan.slot_slices(rank, worker) for i in range(s.start, s.stop)]


@pytest.mark.parametrize("mode", ["drop", "pad"])
def test_random_plans_are_even_and_complete(mode: str) -> None:
    rng = random.Random(0)
    for _ in range(500):
        counts = [rng.choice([0, 1, 3, rng.randint(0, 40), rng.randint(50, 300)])
                  for _ in range(rng.randint(1, 16))]  # fmt: skip
        world, workers, batch = rng.randint(1, 8), rng.randint(1, 4), rng.randint(1, 8)
        plan = plan_epoch(
            counts, world_size=world, num_workers=workers, batch_size=batch, mode=mode,
            seed=rng.randint(0, 9), epoch=rng.randint(0, 3),
        )  # fmt: skip
        per_rank, seen = [], []
        for r in range(world):
            n = 0
            for w in range(workers):
                got = _read(plan, r, w)
                assert len(got) == plan.worker_batches(w) * batch  # whole batches only
                n += len(got)
                seen += got
            per_rank.append(n)
        assert len(set(per_rank)) == 1
        total = sum(counts)
        if mode == "drop":
            assert len(seen) == len(set(seen))  # no sample twice
            assert plan.dropped == total - len(seen) < world * batch
        else:
            assert len(set(seen)) == total or total == 0
            assert plan.repeated == len(seen) - total < world * batch or total == 0


def test_shard_order_changes_per_epoch_and_is_reproducible() -> None:
    kw = dict(world_size=2, num_workers=2, batch_size=2, seed=7)
    a0, a1 = plan_epoch([5] * 20, epoch=0, **kw), plan_epoch([5] * 20, epoch=1, **kw)
    assert a0.order != a1.order
    assert plan_epoch([5] * 20, epoch=1, **kw).order == a1.order


def test_fewer_shards_than_slots_still_even() -> None:
    """3 shards for 2 ranks x 2 workers: every slot reads part of a shard, ranks stay equal."""
    plan = plan_epoch([7, 5, 9], world_size=2, num_workers=2, batch_size=2, seed=1)
    assert plan.batches_per_rank == 5 and plan.dropped == 1
    for rank in (0, 1):
        assert [plan.worker_batches(w) for w in (0, 1)] == [3, 2]
        assert sum(len(_read(plan, rank, w)) for w in (0, 1)) == 10


@pytest.mark.parametrize("mode", ["drop", "pad"])
def test_slices_match_the_virtual_sequence(mode: str) -> None:
    """Slot slices == positions [begin, end) (mod T) of the shards concatenated in plan order."""
    rng = random.Random(1)
    for _ in range(100):
        counts = [rng.randint(0, 20) for _ in range(rng.randint(1, 10))]
        if sum(counts) == 0:
            continue
        plan = plan_epoch(counts, world_size=3, num_workers=2, batch_size=3, mode=mode, seed=5)
        sequence = [(shard, i) for shard in plan.order for i in range(counts[shard])]
        for rank in range(3):
            for worker in range(2):
                begin, end = plan.slot_range(rank, worker)
                expected = [sequence[p % len(sequence)] for p in range(begin, end)]
                assert _read(plan, rank, worker) == expected


@pytest.mark.parametrize("world_size", [1, 2, 3, 7])
def test_assign_shards_gives_every_shard_to_exactly_one_rank_balanced(world_size: int) -> None:
    rng = random.Random(world_size)
    counts = [rng.randrange(0, 500) for _ in range(rng.randrange(1, 40))]
    ranks = assign_shards(counts, world_size)
    assert len(ranks) == world_size
    assert sorted(s for shards in ranks for s in shards) == list(range(len(counts)))
    assert all(shards == sorted(shards) for shards in ranks)
    loads = [sum(counts[s] for s in shards) for shards in ranks]
    assert max(loads) - min(loads) <= max(counts)  # at most one shard apart
    assert assign_shards(counts, world_size) == ranks  # the same on every rank


def test_assign_shards_with_more_ranks_than_shards() -> None:
    assert assign_shards([5, 9], 4) == [[1], [0], [], []]


@pytest.mark.parametrize("mode", ["drop", "pad"])
def test_the_repeats_named_per_batch_are_its_last_and_the_rest_is_each_sample_once(
    mode: str,
) -> None:
    """`repeats_in_batch` (validation leaves them out of its metrics): without them, an unshuffled
    epoch's batches hold every sample once; they are each batch's last ones."""
    rng = random.Random(1)
    for _ in range(300):
        counts = [rng.randint(0, 30) for _ in range(rng.randint(1, 6))]
        world, workers, batch = rng.randint(1, 8), rng.randint(1, 4), rng.randint(1, 16)
        plan = plan_epoch(
            counts, world_size=world, num_workers=workers, batch_size=batch, mode=mode,
            shuffle=False,
        )  # fmt: skip
        if plan.batches_per_rank == 0:
            continue
        kept, repeats = [], 0
        for r in range(world):
            for w in range(workers):
                got = _read(plan, r, w)
                for b in range(plan.worker_batches(w)):
                    n = plan.repeats_in_batch(r, w, b)
                    kept += got[b * batch : (b + 1) * batch - n]
                    repeats += n
        assert sorted(kept) == sorted(set(kept))  # no sample twice
        assert repeats == plan.repeated and len(kept) == sum(counts) - plan.dropped
