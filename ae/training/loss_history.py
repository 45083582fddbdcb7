"""The loss curve's data, read back from the `metrics/<TS>/metrics.csv` of a run's line in its
folder (a resumed run continues the curve of the run it resumed from; `since`: the `<TS>` of the
line's first launch, so that an earlier run of the folder, one that `--overwrite` replaced, is
not drawn): the train and val loss series, and where each epoch ended."""

from __future__ import annotations

import csv
from pathlib import Path

SERIES = {"train/loss": "train loss", "val/loss": "val loss"}
Rows = dict[str, list[tuple[float, dict[str, str]]]]


def _read_series(metrics_dir: Path, keys: dict[str, str], since: str = "") -> Rows:
    """{name: [(step, row)]} of the rows holding each key of `keys` (key -> name) over the
    metrics.csv in `metrics_dir` of the runs from `<TS>` `since` on ("": all); a later run's
    rows replace those of the steps from its first on (a restart past a dead attempt)."""
    history: Rows = {name: [] for name in keys.values()}
    for csv_path in sorted(metrics_dir.glob("*/metrics.csv")):  # <TS> folders sort by time
        if csv_path.parent.name < since:  # a run before this line's first: not its curve
            continue
        with open(csv_path, newline="") as f:
            rows = [r for r in csv.DictReader(f) if r.get("step")]
        rows = [r for r in rows if any(r.get(key) for key in keys)]
        if not rows:
            continue
        start = min(float(r["step"]) for r in rows)
        for points in history.values():
            points[:] = [p for p in points if p[0] < start]
        for row in rows:
            for key, name in keys.items():
                if row.get(key):
                    history[name].append((float(row["step"]), row))
    return history


def read_loss_history(metrics_dir: Path, since: str = "") -> dict[str, list[tuple[float, float]]]:
    """{series name: [(step, value)]} over the metrics.csv in `metrics_dir` of the runs from
    `<TS>` `since` on ("": every run's)."""
    keys = {name: key for key, name in SERIES.items()}
    history = _read_series(metrics_dir, SERIES, since)
    return {
        name: sorted((step, float(row[keys[name]])) for step, row in points)
        for name, points in history.items() if points
    }  # fmt: skip


def read_epoch_ends(metrics_dir: Path, since: str = "") -> list[tuple[float, int]]:
    """(step, epoch) at the end of each epoch: the rows of `train/loss_epoch`, the newest of each
    epoch (a run that --max_steps stopped mid-epoch logs the mean so far; the run resumed from it
    logs the epoch's end later)."""
    (points,) = _read_series(metrics_dir, {"train/loss_epoch": "epoch"}, since).values()
    last: dict[int, float] = {}
    for step, row in points:
        if row.get("epoch"):
            epoch = int(float(row["epoch"]))
            last[epoch] = max(step, last.get(epoch, step))
    return sorted((step, epoch) for epoch, step in last.items())
