"""Sampling without a Trainer run: OOM handling, the PNG grid, and the loss-curve history."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from lightning.pytorch.plugins.precision import Precision
from loguru import logger
from PIL import Image

from ae.config import ModelConfig, parse_config
from ae.data.decoding.decode import InputSpec
from ae.data.shards.spec import resolve_shards
from ae.data.shards.tar_header_count import count_samples
from ae.data.stream import stages as stream_module
from ae.data.stream.shard_stream import ShardStream
from ae.forensics import faults as fault_injection
from ae.run_paths import RunDir
from ae.training.ema import EMA, averaged_weights
from ae.training.loss_curve import LossCurve
from ae.training.loss_history import read_epoch_ends, read_loss_history
from ae.training.model import AutoEncoder
from ae.training.plots import log_y_axis, loss_plot, reconstruction_grid
from ae.training.sampling import Sampling, is_oom, reconstruct
from tests.support.shards import image_decoder


def test_is_oom() -> None:
    assert is_oom(torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2 GiB"))
    assert is_oom(RuntimeError("[enforce fail] DefaultCPUAllocator: can't allocate: out of memory"))
    assert not is_oom(RuntimeError("shape mismatch")) and not is_oom(ValueError("out of memory"))


def _fake_trainer(spec: str, out: Path, tar_reader: str = "fast") -> SimpleNamespace:
    urls, _ = resolve_shards(spec, spec)
    val = ShardStream(
        split="val", urls=urls, counts=[count_samples(u) for u in urls],
        decoder=image_decoder(8), batch_size=4, rank=0, world_size=1, num_workers=0,
        shuffle=False, tar_reader=tar_reader,
    )  # fmt: skip
    return SimpleNamespace(
        datamodule=SimpleNamespace(val_set=val), precision_plugin=Precision(), global_step=2,
        global_rank=0, is_global_zero=True, should_stop=False, loggers=[],
    )  # fmt: skip


def test_oom_is_logged_batch_halved_and_the_next_sampling_works(
    make_shards, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cfg = parse_config([f"--output_dir={tmp_path}", "--sample_period=2",
                        "--sample_batch_size=4", "--num_sample_batches=2"])  # fmt: skip
    trainer = _fake_trainer(make_shards([12], kind="png", name="val"), tmp_path)
    model = AutoEncoder(InputSpec("image", (1, 8, 8)), ModelConfig(hidden_dim=16, latent_dim=4))
    lines: list[str] = []
    sink = logger.add(lines.append, format="{level} {message}")
    # What AE_FAULT=oom@sampling parses into, on first use.
    monkeypatch.setattr(fault_injection, "_faults", fault_injection.parse_faults("oom@sampling"))
    monkeypatch.setattr(fault_injection, "_fired", set())
    try:
        sampling = Sampling(cfg.obs, cfg.run.dir)
        sampling.sample(trainer, model)
        assert sampling.batch_size == 2 and not (tmp_path / "samples").exists()
        trainer.global_step = 4
        sampling.sample(trainer, model)
    finally:
        logger.remove(sink)
    text = "".join(lines)
    assert "WARNING SAMPLING OOM at step 2 with batch 4 per device: OutOfMemoryError" in text
    assert "memory at failure rss=" in text and "sampling batch halved to 2" in text
    assert "SAMPLING END ========== step 2: out of memory" in text
    assert "SAMPLING START ========== step 4: 2 batch(es) x 2 per device" in text
    assert "SAMPLING END ========== step 4: reconstruction loss=" in text
    assert model.training  # put back in train mode
    with Image.open(tmp_path / "samples" / "step_00000004.png") as img:
        assert img.size[0] > img.size[1] > 64


def test_sampling_reads_through_the_streams_own_tar_reader(
    make_shards, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """--tar_reader=tarfile applies to the sampling inputs too (they once had a pipeline of their
    own, always on the fast reader)."""
    trainer = _fake_trainer(make_shards([12], kind="png", name="val"), tmp_path, "tarfile")
    readers: list[str] = []
    real = stream_module.iter_samples

    def spy(url: str, offset: int = 0, reader: str = "fast", count: object = None) -> object:
        readers.append(reader)
        return real(url, offset, reader, count)

    monkeypatch.setattr(stream_module, "iter_samples", spy)
    cfg = parse_config([f"--output_dir={tmp_path}", "--sample_batch_size=4"])
    inputs = Sampling(cfg.obs, cfg.run.dir).sample_inputs(trainer)
    assert inputs.shape == (4, 1, 8, 8)
    assert readers and set(readers) == {"tarfile"}


def test_oom_at_batch_one_turns_sampling_off(tmp_path: Path) -> None:
    cfg = parse_config([f"--output_dir={tmp_path}", "--sample_period=5", "--sample_batch_size=1"])
    sampling = Sampling(cfg.obs, cfg.run.dir)
    assert "turned off" in sampling._after_oom(5, "OutOfMemoryError: x", "rss=1MB")
    assert sampling.period == -1


def test_reconstruction_grid_layout(tmp_path: Path) -> None:
    x = np.random.default_rng(0).random((10, 3, 16, 16), dtype=np.float32)
    reconstruction_grid(x, np.clip(x + 0.5, 0, 2), tmp_path / "g.png", per_row=8, tile=64)
    with Image.open(tmp_path / "g.png") as img:
        # 8 per row of 16x16 scaled x4; two groups (inputs + reconstructions each)
        assert img.size == (34 + 8 * 68 + 4, 2 * (2 * 64 + 12) + 4) and img.mode == "RGB"


def test_loss_history_of_a_resumed_run_continues_the_curve(tmp_path: Path) -> None:
    def write(ts: str, rows: list[tuple[int, str, str]]) -> None:
        path = tmp_path / ts / "metrics.csv"
        path.parent.mkdir()
        path.write_text(
            "step,train/loss,val/loss\n" + "".join(f"{s},{t},{v}\n" for s, t, v in rows)
        )

    write("20260101_000000", [(0, "1.0", ""), (4, "0.8", "0.9"), (8, "0.6", ""), (9, "", "0.7")])
    write("20260101_010000", [(5, "0.75", ""), (10, "0.5", "0.55")])  # resumed from step 5
    history = read_loss_history(tmp_path)
    assert history["train loss"] == [(0, 1.0), (4, 0.8), (5, 0.75), (10, 0.5)]
    assert history["val loss"] == [(4, 0.9), (10, 0.55)]
    loss_plot(history, tmp_path / "curve.png")
    with Image.open(tmp_path / "curve.png") as img:
        assert img.format == "PNG" and img.size == (720, 420)
    loss_plot({"x": []}, tmp_path / "none.png")  # nothing to draw: no file
    assert not (tmp_path / "none.png").exists()


def test_the_loss_curve_of_a_fresh_run_leaves_out_the_folders_earlier_runs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A 10-step run logged every step, then `--overwrite` started a 100-step run afresh in the
    folder (logging every 10 steps): its curve began with the old run's steps 1-9 and the old
    run's epochs on its top axis. A resume of the fresh run keeps to its line too, and so does
    one from a checkpoint that recorded only the TensorBoard run (older code)."""
    from ae.training import loss_curve, metrics

    cfg = parse_config([f"--output_dir={tmp_path}", "--logger=csv,tensorboard"])
    run_dir = cfg.run.dir
    old = run_dir.metrics / "20260101_000000"
    old.mkdir(parents=True)
    (old / "metrics.csv").write_text(
        "epoch,step,train/loss,train/loss_epoch\n"
        + "".join(f"0,{s},9.0,\n" for s in range(1, 10))
        + "0,5,,9.5\n"
    )
    drawn: list[tuple[dict, list]] = []
    monkeypatch.setattr(
        loss_curve,
        "loss_plot",
        lambda history, path, marks, epoch_ends: drawn.append((history, epoch_ends)),
    )

    def launch(ts: str, runs: dict[str, str], resumed: int | None, steps: range) -> dict:
        loggers = metrics.build_loggers(cfg.obs, run_dir, ts, runs, resumed_step=resumed)
        for step in steps:
            for lg in loggers:
                lg.log_metrics({"train/loss": 1.0 / step}, step)
        for lg in loggers:
            lg.log_metrics({"train/loss_epoch": 0.5, "epoch": 0}, steps[-1])
        trainer = SimpleNamespace(is_global_zero=True, loggers=loggers, callbacks=[])
        LossCurve(run_dir).on_fit_end(trainer, None)  # type: ignore[arg-type]
        return metrics.logger_runs(loggers)

    runs = launch("20260102_000000", {}, None, range(10, 101, 10))
    assert runs == {"csv": "20260102_000000", "tensorboard": "20260102_000000"}
    history, ends = drawn[-1]
    assert [s for s, _ in history["train loss"]] == list(range(10, 101, 10))
    assert ends == [(100.0, 0)]
    # resumed at step 50 from the fresh run's checkpoint: its line, the old run left out
    again = launch("20260103_000000", runs, 50, range(60, 121, 10))
    assert again["csv"] == "20260102_000000"
    assert [s for s, _ in drawn[-1][0]["train loss"]] == list(range(10, 121, 10))
    # a checkpoint of older code holds the TensorBoard run alone: the same first launch
    launch("20260104_000000", {"tensorboard": "20260102_000000"}, 50, range(60, 71, 10))
    assert [s for s, _ in drawn[-1][0]["train loss"]] == [10, 20, 30, 40, 50, 60, 70]
    assert metrics.first_csv_run({}, "20260105_000000", 50) == ""  # nothing recorded: all


def test_a_failed_run_draws_its_loss_curve_up_to_the_failure(tmp_path: Path) -> None:
    """A run that failed (a NaN that stopped it, a peer that died) left no loss_curve.png, or
    the one of the launch it resumed: drawn in `on_exception` from what was logged. A failure
    while drawing it is a warning in the rank's log, never in place of the run's own error."""
    from ae.training.metrics import build_loggers

    cfg = parse_config([f"--output_dir={tmp_path}", "--logger=csv"])
    (csv_logger,) = build_loggers(cfg.obs, cfg.run.dir, "20260101_000000", {})
    for step in range(1, 6):
        csv_logger.log_metrics({"train/loss": 1.0 / step}, step)
    trainer = SimpleNamespace(is_global_zero=True, loggers=[csv_logger], callbacks=[])
    lines: list[str] = []
    sink = logger.add(lines.append, format="{level} {message}")
    try:
        LossCurve(cfg.run.dir).on_exception(trainer, None, RuntimeError("peer died"))  # type: ignore[arg-type]
        with Image.open(cfg.run.dir.loss_curve) as img:
            assert img.format == "PNG"
        assert f"INFO Loss curve (up to the failure): {cfg.run.dir.loss_curve}\n" in lines

        def broken() -> None:
            raise OSError("No space left on device")

        csv_logger.save = broken  # type: ignore[method-assign]
        LossCurve(cfg.run.dir).on_exception(trainer, None, RuntimeError("peer died"))  # type: ignore[arg-type]
    finally:
        logger.remove(sink)
    assert lines[-1] == (
        "WARNING Loss curve not drawn after the failure: OSError: No space left on device\n"
    )


def test_the_log_axis_labels_enough_ticks_for_the_range_of_losses() -> None:
    """0.065-0.17 (under half a decade) has labels above 0.1 (0.12, 0.15); 0.01-0.35 labels
    0.02, 0.05, 0.2 besides the decades; 5-2e-4 only the decades."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    def labels(values: list[float]) -> list[str]:
        fig = Figure()
        FigureCanvasAgg(fig)
        ax = fig.add_subplot()
        ax.plot(range(len(values)), values)
        log_y_axis(ax, values)
        fig.canvas.draw()
        lo, hi = ax.get_ylim()
        ticks = [*ax.yaxis.get_major_ticks(), *ax.yaxis.get_minor_ticks()]
        return sorted(
            (t.label1.get_text() for t in ticks if t.label1.get_text() and lo <= t.get_loc() <= hi),
            key=float,
        )

    assert {"0.12", "0.15"} <= set(labels([0.065, 0.1, 0.17]))
    # a demo run's curve: nothing labelled between 0.1 and its first points at 0.19
    assert {"0.12", "0.15"} <= set(labels([0.032, 0.1, 0.19]))
    assert {"0.02", "0.05", "0.1", "0.2"} <= set(labels([0.01, 0.35]))
    assert "0.03" not in labels([0.01, 0.35])
    assert labels([2e-4, 5.0]) == ["0.001", "0.01", "0.1", "1"]


def test_grid_at_each_epoch_end_for_images_once_per_step(make_shards, tmp_path: Path) -> None:
    trainer = _fake_trainer(make_shards([12], kind="png", name="val"), tmp_path)
    model = AutoEncoder(InputSpec("image", (1, 8, 8)), ModelConfig(hidden_dim=16, latent_dim=4))
    cfg = parse_config([f"--output_dir={tmp_path}", "--sample_batch_size=4"])
    lines: list[str] = []
    sink = logger.add(lines.append, format="{message}")
    try:
        sampling = Sampling(cfg.obs, cfg.run.dir)
        sampling.on_train_epoch_end(trainer, model)
        sampling.on_train_epoch_end(trainer, model)  # the same step again: no second grid
        off = parse_config([f"--output_dir={tmp_path}/off", "--sample_every_epoch=false"])
        Sampling(off.obs, off.run.dir).on_train_epoch_end(trainer, model)
    finally:
        logger.remove(sink)
    assert [p.name for p in (tmp_path / "samples").iterdir()] == ["step_00000002.png"]
    assert sum("SAMPLING START" in line for line in lines) == 1
    assert not (tmp_path / "off" / "samples").exists()


def test_vector_data_gets_no_epoch_end_sampling(tmp_path: Path) -> None:
    trainer = SimpleNamespace(
        datamodule=SimpleNamespace(val_set=SimpleNamespace(spec=InputSpec("vector", (4,)))),
        should_stop=False, global_step=3,
    )  # fmt: skip
    cfg = parse_config([f"--output_dir={tmp_path}"])
    sampling = Sampling(cfg.obs, cfg.run.dir)
    sampling.sample = lambda *a: pytest.fail("sampled vector data at an epoch end")
    sampling.on_train_epoch_end(trainer, None)


def test_sampling_shows_the_ema_weights(make_shards, tmp_path: Path) -> None:
    """The grid is the average's, and the live weights are back, unchanged, after it."""
    trainer = _fake_trainer(make_shards([12], kind="png", name="val"), tmp_path)
    model = AutoEncoder(InputSpec("image", (1, 8, 8)), ModelConfig(hidden_dim=16, latent_dim=4))
    ema = EMA(decay=0.5)
    ema.setup(trainer, model, "fit")  # the average starts as a copy of the model
    cfg = parse_config([f"--output_dir={tmp_path}", "--sample_batch_size=4"])
    sampling = Sampling(cfg.obs, cfg.run.dir)
    x = sampling.sample_inputs(trainer)
    with torch.no_grad():
        averaged = reconstruct(model.eval(), x)
        for p in model.parameters():
            p.add_(0.1)  # the live weights move on
        live = {k: v.clone() for k, v in model.state_dict().items()}
        moved = reconstruct(model, x)
    trainer.callbacks = [ema]
    _, recon = sampling._reconstruct(trainer, model, x)
    assert torch.allclose(recon, averaged) and not torch.allclose(recon, moved)
    assert all(torch.equal(v, live[k]) for k, v in model.state_dict().items())
    trainer.callbacks = []  # no EMA: the model's own weights
    _, recon = sampling._reconstruct(trainer, model, x)
    assert torch.allclose(recon, moved)
    with averaged_weights(trainer, model):
        assert all(torch.equal(v, live[k]) for k, v in model.state_dict().items())


def test_a_model_without_encode_decode_is_not_sampled(make_shards, tmp_path: Path) -> None:
    """A user LightningModule without encode/decode: sampling turns itself off, no crash."""
    trainer = _fake_trainer(make_shards([12], kind="png", name="val"), tmp_path)
    cfg = parse_config([f"--output_dir={tmp_path}", "--sample_period=2"])
    sampling = Sampling(cfg.obs, cfg.run.dir)
    sampling.sample(trainer, torch.nn.Linear(2, 2))
    assert sampling.period == -1 and not sampling.every_epoch
    assert not (tmp_path / "samples").exists()


def test_the_sampled_loss_is_the_runs_own_pixel_loss(make_shards, tmp_path: Path) -> None:
    """`Sampling at step N: reconstruction loss` was the MSE whatever --loss: under the recipe's
    --loss=l1 it read 0.22 beside val/recon=0.40 of the same images."""
    cfg = parse_config([f"--output_dir={tmp_path}", "--sample_batch_size=4"])
    trainer = _fake_trainer(make_shards([12], kind="png", name="val"), tmp_path)
    model = AutoEncoder(
        InputSpec("image", (1, 8, 8)), ModelConfig(hidden_dim=16, latent_dim=4, loss="l1")
    )
    lines: list[str] = []
    sink = logger.add(lines.append, format="{message}")
    try:
        sampling = Sampling(cfg.obs, cfg.run.dir)
        sampling.sample(trainer, model)
    finally:
        logger.remove(sink)
    (line,) = [t for t in lines if t.startswith("Sampling at step 2:")]
    x = sampling.sample_inputs(trainer)
    with torch.no_grad():
        l1 = torch.nn.functional.l1_loss(reconstruct(model.eval(), x), x).item()
    assert line.startswith(f"Sampling at step 2: reconstruction loss (l1) {l1:.6f} ")


def test_an_epoch_that_max_steps_cut_is_no_epoch_done_on_the_loss_curve(tmp_path: Path) -> None:
    """46 batches an epoch; --max_steps=60 stops in epoch 1, whose mean so far is logged as
    `train/loss_epoch` at step 60: the curve's top axis read "2" epochs done there. Resumed to
    step 80 (still in epoch 1), then to the end of epoch 1 at step 92."""
    run_dir = RunDir(tmp_path)
    header = "epoch,step,train/loss,train/loss_epoch\n"
    runs = [("20260101_000000", ["0,46,,0.5", "1,60,,0.4"]), ("20260101_000100", ["1,80,,0.3"]),
            ("20260101_000200", ["1,92,,0.2"])]  # fmt: skip
    curve = LossCurve(run_dir)
    expected = [[(46.0, 0)], [(46.0, 0)], [(46.0, 0), (92.0, 1)]]
    for (ts, rows), whole, want in zip(runs, (False, False, True), expected, strict=True):
        (run_dir.metrics / ts).mkdir(parents=True)
        (run_dir.metrics / ts / "metrics.csv").write_text(header + "\n".join(rows) + "\n")
        epoch_end = SimpleNamespace(is_last_batch=whole, current_epoch=1)
        curve.on_train_epoch_end(epoch_end, None)  # type: ignore[arg-type]
        assert curve.epoch_ends() == want
    assert read_epoch_ends(run_dir.metrics) == [(46.0, 0), (92.0, 1)]  # the newest of each epoch


def test_the_loss_curve_marks_the_epochs_and_keeps_its_legend_off_the_newest_points(
    tmp_path: Path,
) -> None:
    """A resumed 4-epoch run (two metrics.csv): no epoch was marked, and the legend, fixed in
    the upper right corner, hid the last train point (0.50 at step 4)."""
    header = "epoch,step,train/loss,train/loss_epoch,val/loss\n"
    for ts, rows in (("20260101_000000", ["0,1,0.48,,", "0,1,,0.51,0.47", "1,2,0.41,,",
                                          "1,2,,0.48,0.45"]),
                     ("20260101_000100", ["2,3,0.45,,", "2,3,,0.45,0.43", "3,4,0.50,,",
                                          "3,4,,0.43,0.41"])):  # fmt: skip
        (tmp_path / ts).mkdir()
        (tmp_path / ts / "metrics.csv").write_text(header + "\n".join(rows) + "\n")
    ends = read_epoch_ends(tmp_path)
    assert ends == [(1.0, 0), (2.0, 1), (3.0, 2), (4.0, 3)]
    fig = loss_plot(read_loss_history(tmp_path), tmp_path / "c.png", epoch_ends=ends)
    assert fig is not None
    (ax,) = fig.axes
    (top,) = ax.child_axes
    assert top.get_xlabel() == "epochs done"
    assert [t.get_text() for t in top.get_xticklabels()] == ["1", "2", "3", "4"]
    fig.canvas.draw()
    legend = ax.get_legend().get_window_extent()
    for line in ax.get_lines()[:2]:  # train, val: every point outside the legend's box
        for x, y in zip(*line.get_data(), strict=True):
            assert not legend.contains(*ax.transData.transform((x, y))), (line.get_label(), x)
    # many epochs: every 10th of 100 is marked
    many = [(float(5 * (e + 1)), e) for e in range(100)]
    fig = loss_plot({"train loss": [(s, 1.0 / s) for s, _ in many]}, tmp_path / "m.png",
                    epoch_ends=many)  # fmt: skip
    assert fig is not None
    labels = [t.get_text() for t in fig.axes[0].child_axes[0].get_xticklabels()]
    assert labels == [str(n) for n in range(10, 101, 10)]
