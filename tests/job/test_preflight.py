"""The preflight's reckoning: needs from the run's figures, refused above what there is, warned
above TIGHT of it, each message with the resource, its size, the need and the fix."""

from __future__ import annotations

from pathlib import Path

import pytest

from ae.config import parse_config
from ae.errors import ResourceLimitError
from ae.job.preflight import (
    MB,
    TIGHT,
    Need,
    check,
    disk_need,
    fd_need,
    launcher_needs,
    logs_disk_need,
    rank_needs,
    shm_need,
    shm_size_flag,
)


def need(have: int, n: int) -> Need:
    return Need("thing", have, n, "how", "fix it")


def test_refused_above_what_there_is_warned_when_tight() -> None:
    with pytest.raises(ResourceLimitError) as e:
        check([need(100 * MB, 101 * MB), need(100 * MB, 10 * MB)])
    assert e.value.problems == [
        "thing: 100.0 MB available, the run needs about 101.0 MB (how); fix: fix it"
    ]
    assert "cannot work within this machine's limits" in e.value.render()
    tight = check([need(100 * MB, int(TIGHT * 100 * MB) + 1), need(100 * MB, 10 * MB)])
    assert tight == ["thing: 100.0 MB available, the run needs about 80.0 MB (how); fix: fix it"]
    assert check([Need("unknown", None, 10**12, "how", "fix")]) == []  # not known: no check


def test_shm_need_counts_every_batch_in_flight() -> None:
    n = shm_need(4 * MB, workers=2, local_ranks=2, prefetch=4)
    assert n.need == 80 * MB  # 4 MB x 4 x 2 x 2 x 1.25
    assert "batch 4.0 MB x prefetch_factor 4 x 2 workers x 2 local ranks" in n.how
    assert "--shm-size=256m" in n.fix and "--batch_size" in n.fix
    assert shm_need(4 * MB, workers=0, local_ranks=2, prefetch=4).have is None  # no workers
    assert shm_size_flag(600 * MB) == "2g"


def test_disk_need_counts_kept_checkpoints_and_logs(tmp_path: Path) -> None:
    n = disk_need(tmp_path, 10 * MB, keep=3, best=True)
    assert n.need == 10 * MB * 5 + 64 * MB  # 3 kept + 1 being written + best, and the logs
    assert "--checkpoints_total_limit=3" in n.how and "--checkpoints_total_limit" in n.fix


def test_the_launcher_reckons_the_logs_alone(tmp_path: Path) -> None:
    """Before the model is known there is no checkpoint size to tell: no `checkpoint 0.0 MB x 1`."""
    n = logs_disk_need(tmp_path)
    assert (n.need, n.how) == (64 * MB, "logs 64.0 MB")
    assert "checkpoint" not in n.fix
    cfg = parse_config([f"--output_dir={tmp_path}"])
    (disk,) = [d for d in launcher_needs(cfg, 2, 2, 4) if d.resource.startswith("disk")]
    assert disk.how == "logs 64.0 MB"
    assert disk.describe().endswith(
        "(logs 64.0 MB); fix: free space there, or another --output_dir"
    )


def test_fd_need_grows_with_workers_and_peers() -> None:
    small, big = fd_need(1, 2, 4), fd_need(8, 16, 4)
    assert small.count and small.amount(small.need) == str(small.need)
    assert big.need - small.need == 7 * 12 + 14 * 4
    assert big.fix == "ulimit -n 65536"


def test_launcher_and_rank_needs_use_the_flags(tmp_path: Path) -> None:
    cfg = parse_config([f"--output_dir={tmp_path}", "--num_workers=3",
                        "--checkpoints_total_limit=2", "--save_best=false"])  # fmt: skip
    resources = [n.resource for n in launcher_needs(cfg, 2, 4, 4)]
    assert resources == ["open files (ulimit -n)", f"disk of {tmp_path}", "host memory"]
    needs = rank_needs(cfg, batch_bytes=MB, state_bytes=2 * MB, local_ranks=2, world_size=4,
                       prefetch=4)  # fmt: skip
    shm, disk, memory, _ = needs
    assert shm.need == int(MB * 4 * 3 * 2 * 1.25)
    assert disk.need == 6 * MB * 3 + 64 * MB  # checkpoint = 3x the state dict, 2 kept + 1
    assert "2 local ranks" in memory.how and "3 workers" in memory.how
