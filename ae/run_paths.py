"""The run folder (`--output_dir`): every path of a run is named here, once. The tree, and what
each file holds, is described once: docs/CONTRACT.md, "Runs and folders".
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class RunDir:
    root: Path

    @property
    def lock(self) -> Path:
        """One run per folder: the lock file of the job that runs in it (ae.job.folder_lock)."""
        return self.root / "run.lock"

    def refused(self, node: int | str) -> Path:
        """A node whose launcher refused to join the job (started otherwise than node 0) says
        so here, for node 0's launcher, which waits for it (ae.job.folder_lock); `node="*"`:
        the pattern."""
        return self.root / f"refused_node{node}.json"

    def failed(self, node: int | str) -> Path:
        """A node whose ranks failed says so here, with their error, for the other nodes'
        launchers, whose ranks would wait for its ranks up to --pg_timeout (ae.job.same_job);
        `node="*"`: the pattern."""
        return self.root / f"failed_node{node}.json"

    @property
    def config_yaml(self) -> Path:
        return self.root / "config.yaml"

    @property
    def logs(self) -> Path:
        return self.root / "logs"

    @property
    def checkpoints(self) -> Path:
        return self.root / "checkpoints"

    @property
    def samples(self) -> Path:
        return self.root / "samples"

    @property
    def metrics(self) -> Path:
        """Parent of the per-run `<TS>/metrics.csv` folders (Lightning's CSVLogger layout)."""
        return self.root / "metrics"

    @property
    def tensorboard(self) -> Path:
        return self.root / "tensorboard"

    @property
    def wandb(self) -> Path:
        """W&B's own folder (`--logger=wandb`; offline runs stay here until `wandb sync`)."""
        return self.root / "wandb"

    @property
    def mlruns(self) -> Path:
        """The MLflow file store of `--logger=mlflow` (unless --mlflow_tracking_uri)."""
        return self.root / "mlruns"

    @property
    def loss_curve(self) -> Path:
        return self.root / "loss_curve.png"


def checkpoints_in_folder(folder: Path, most: int = 3) -> str | None:
    """What to say of a folder named where a checkpoint file belongs (a run folder, or its
    checkpoints/): `; name one of its checkpoints: <up to `most` of them>`, or `; name a
    checkpoint file` when it holds none. None when `folder` is no folder."""
    if not folder.is_dir():
        return None
    found = sorted(folder.glob("*.ckpt")) or sorted(RunDir(folder).checkpoints.glob("*.ckpt"))
    names = ", ".join(str(p) for p in found[:most]) + (", ..." if len(found) > most else "")
    return f"; name one of its checkpoints: {names}" if found else "; name a checkpoint file"
