"""Step times: how a batch's wall time splits into data wait, compute and sync, the rolling
windows, and the all-reduce wait timed from the last gradient bucket."""

from __future__ import annotations

import time

import pytest
import torch

from ae.forensics import step_times as st
from ae.forensics.step_times import StepTimes


def test_a_batch_splits_into_data_compute_and_sync() -> None:
    t = StepTimes(recent_s=30)
    t.fetched(0.0, 0.010)  # the first batch starts the clock at its fetch
    assert t.batch_end(0.030, steps=1) == (0.030, 1, 0.010, pytest.approx(0.020), 0.0)
    # next batch: 2 ms between steps (broadcast, callbacks), 5 ms data wait, an all-reduce that
    # waits 12 ms after its last bucket is launched (an earlier bucket overlapped compute)
    t.fetched(0.032, 0.037)
    t.collective(0.040, 0.045)
    t.collective(0.050, 0.062)
    _, steps, data, compute, sync = t.batch_end(0.070, steps=1)  # type: ignore[misc]
    assert (steps, data) == (1, pytest.approx(0.005))
    assert compute == pytest.approx(0.070 - 0.037 - 0.012)  # own work, without the wait
    assert sync == pytest.approx(0.002 + 0.012)  # between steps + all-reduce wait
    assert t.epoch == (2, pytest.approx(0.015), pytest.approx(0.041), pytest.approx(0.014))
    assert t.last is not None and t.last[0] == 0.070


def test_windows_per_optimizer_step() -> None:
    t = StepTimes(recent_s=10)
    now = 0.0
    for i in range(20):  # 2 batches per optimizer step (accumulation), 1 s each
        t.fetched(now, now + 0.25)
        now += 1.0
        t.batch_end(now, steps=i % 2)
    w = t.window(now)
    assert w is not None and w["steps"] == 5  # 10 batches in the last 10 s
    assert w["data_ms"] == 500.0 and w["own_ms"] == 2000.0 and w["sync_ms"] == 0.0
    assert t.epoch_window()["steps"] == 10  # type: ignore[index]
    assert t.window(now + 60) is None  # nothing recent: no figures
    t.new_epoch()
    assert t.epoch_window() is None


def test_the_run_total_of_data_wait_spans_the_epochs() -> None:
    t = StepTimes()
    for epoch_start in (0.0, 10.0):  # two epochs, 2 batches each, 2 ms and 5 ms of data wait
        t.new_epoch()
        t.fetched(epoch_start, epoch_start + 0.002)
        t.batch_end(epoch_start + 0.010, steps=1)
        t.fetched(epoch_start + 0.010, epoch_start + 0.015)
        t.batch_end(epoch_start + 0.020, steps=1)
    assert t.epoch[0] == 2  # the epoch's count starts again
    steps, data = t.run
    assert steps == 4 and data == pytest.approx(0.014)
    assert t.heartbeat()["timing"]["run"] == {"steps": 4, "data_s": 0.014}


def test_validation_is_no_part_of_the_next_step() -> None:
    t = StepTimes()
    t.fetched(0.0, 0.001)
    t.batch_end(0.010, steps=1)
    t.restart()  # validation ran from 0.010 to 5.0
    t.fetched(5.0, 5.001)
    _, _, data, compute, sync = t.batch_end(5.010, steps=1)  # type: ignore[misc]
    assert data + compute + sync == pytest.approx(0.010)


def test_heartbeat_carries_the_workers_of_the_data_module() -> None:
    t = StepTimes()
    run = {"steps": 0, "data_s": 0.0}
    assert t.heartbeat() == {
        "timing": {"recent": None, "epoch": None, "run": run},
        "data_workers": [],
    }
    t.data_workers = lambda: [{"worker": 0}]
    assert t.heartbeat()["data_workers"] == [{"worker": 0}]


def test_the_all_reduce_wait_is_timed_from_the_last_ready_bucket(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """DDP's comm hook calls `gradients_ready` as each bucket is launched (the hook itself:
    tests/training/test_nonfinite_ddp.py); backward's end closes the wait from the last one."""
    times = StepTimes()
    monkeypatch.setattr(st, "step_times", times)
    times.fetched(0.0, 0.0)
    st.gradients_ready()
    first = times.last_grad_ready
    st.gradients_ready()
    assert first is not None and times.last_grad_ready is not None
    assert times.last_grad_ready >= first  # the last bucket's time is kept
    done = time.perf_counter()
    times.backward_done(done)
    assert times._collectives == [(times._collectives[0][0], done)]
    assert times._collectives[0][0] >= first
    assert times.last_grad_ready is None  # read once
    times.backward_done(time.perf_counter())  # no DDP (no bucket this step): nothing timed
    assert len(times._collectives) == 1


def test_the_loss_is_read_in_the_training_step_phase() -> None:
    """The cadence's `.item()` waits for the GPU's step: a kernel that hangs there must read as
    `training step`, not `data loading` (seen on an H200 with AE_FAULT=gpusleep)."""
    from types import SimpleNamespace

    from ae.forensics.loop_tracer import DebugCallback
    from ae.forensics.progress import progress

    seen: list[str] = []

    class Loss:
        def item(self) -> float:
            seen.append(progress.phase)
            return 1.0

    tracer = DebugCallback(debug=False, every_train=1, every_val=1)
    trainer = SimpleNamespace(global_step=1, num_training_batches=100, current_epoch=0)
    progress.enter("training step", step=0)
    tracer.on_train_batch_end(trainer, None, {"loss": Loss()}, None, 0)
    assert seen == ["training step"]
    assert progress.phase == "data loading"


def test_the_epoch_end_says_samples_per_second_and_what_bounds_the_job(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """One rank, 10 steps of 8 samples, each 90 ms waiting for data and 10 ms of compute: the
    train log's `Throughput` line after `Step times` says 80 samples/s and input-bound, with the
    advice for a rank without workers."""
    from types import SimpleNamespace

    from loguru import logger

    from ae.forensics import loop_tracer
    from ae.log_lines import THROUGHPUT

    times = StepTimes()
    times.epoch = (10, 0.9, 0.1, 0.0)
    monkeypatch.setattr(loop_tracer, "step_times", times)
    tracer = loop_tracer.DebugCallback(
        debug=False, every_train=1, every_val=1, batch_size=8, num_workers=0
    )
    trainer = SimpleNamespace(world_size=1, global_rank=0, current_epoch=3, num_devices=1,
                              accumulate_grad_batches=1)  # fmt: skip
    lines: list[str] = []
    handle = logger.add(lambda m: lines.append(m.record["message"]), format="{message}")
    try:
        tracer._step_times_line(trainer, SimpleNamespace(device="cpu"))  # type: ignore[arg-type]
    finally:
        logger.remove(handle)
    (m,) = [m for line in lines if (m := THROUGHPUT.parse(line))]
    assert (m["epoch"], m["samples_per_s"], m["step_ms"]) == ("3", "80", "100.0")
    assert m["split"] == "data wait 90.0, compute 10.0, sync 0.0 ms"
    assert m["verdict"].startswith("input-bound: the rank waits for data 90% of its own time")
    assert "(--num_workers=0): give it workers" in m["verdict"]


def test_a_long_epoch_says_how_far_it_is_on_the_console(monkeypatch: pytest.MonkeyPatch) -> None:
    """Rank 0 without a progress bar (the launcher's console, a SLURM output file): a minute into
    the epoch, then every ten minutes, a TRAIN_PROGRESS line in the main log; an epoch of hours
    said nothing between its start and its end. Not on another rank, nor beside a progress bar."""
    from types import SimpleNamespace

    from loguru import logger

    from ae.forensics import loop_tracer
    from ae.log_lines import TRAIN_PROGRESS

    now = [1000.0]
    monkeypatch.setattr(loop_tracer.time, "perf_counter", lambda: now[0])
    monkeypatch.setattr(loop_tracer, "step_times", StepTimes())
    lines: list[str] = []
    handle = logger.add(lambda m: lines.append(m.record["message"]), format="{message}")
    try:
        for rank, bar in ((0, None), (1, None), (0, object())):
            tracer = loop_tracer.DebugCallback(debug=False, every_train=10**6, every_val=1)
            trainer = SimpleNamespace(global_rank=rank, progress_bar_callback=bar, current_epoch=2,
                                      global_step=0, num_training_batches=4000)  # fmt: skip
            now[0] = 1000.0
            tracer.on_train_epoch_start(trainer, None)  # type: ignore[arg-type]
            for batch in range(1, 3001):  # a batch every 0.5 s: 25 minutes
                now[0] += 0.5
                trainer.global_step = batch
                out = {"loss": torch.tensor(0.25)}
                tracer.on_train_batch_end(trainer, None, out, None, batch - 1)  # type: ignore[arg-type]
    finally:
        logger.remove(handle)
    said = [m for line in lines if (m := TRAIN_PROGRESS.parse(line))]
    assert [(m["batch"], m["pct"], m["eta"]) for m in said] == [
        ("120", "3", "32m"),
        ("1320", "33", "22m"),
        ("2520", "63", "12m"),
    ]  # at 1, 11 and 21 minutes; 2 batches/s, 3880 / 2 s left after the first
    assert all((m["epoch"], m["batches"], m["rate"], m["loss"]) == ("2", "4000", "2", "0.25")
               for m in said)  # fmt: skip
