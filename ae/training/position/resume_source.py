"""`--resume_from_checkpoint`: which file a run resumes from, read once before training by the
one checkpoint reader (`checkpoint_read`), and what the run takes from it before Lightning loads
it: whether its model fits these flags (`model_fit`), the logger runs to continue and the data
module's state, whose hold-out record the data is planned with (`ShardDataModule.resume_plan`)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import lightning as L
from loguru import logger
from torch import nn

from ae.training.checkpoint_files import LAST
from ae.training.metrics import LOGGER_RUNS
from ae.training.position.checkpoint_read import NotAnAeCheckpoint, read_ae_checkpoint
from ae.training.position.model_fit import check_resume


def resolve_resume(
    value: str | None, checkpoints_dir: Path, expected: str | None = None
) -> Path | None:
    """`--resume_from_checkpoint`: a path, or `last`. `last` with no checkpoint yet (the first
    run of a job that is requeued with the same command) starts from scratch. `expected`: the
    checkpoint the launcher's RESTART line promised, which someone may have deleted since."""
    if value is None:
        return None
    if value != "last":
        return Path(value)
    last = Path(checkpoints_dir) / LAST
    if last.is_file():
        return last
    if expected is not None:
        logger.warning(
            f"--resume_from_checkpoint=last: no {last}: the checkpoint this restart was to "
            f"resume from ({expected}) is gone (was {checkpoints_dir} deleted?); starting from "
            "scratch"
        )
    else:
        logger.warning(f"--resume_from_checkpoint=last: no {last} yet; starting from scratch")
    return None


@dataclass
class ResumeSource:
    """The checkpoint a run resumes from, as read."""

    path: Path
    checkpoint: dict[str, Any]

    @property
    def step(self) -> int:
        """The optimizer steps done when it was saved."""
        return int(self.checkpoint.get("global_step", 0))

    def logger_runs(self) -> dict[str, str]:
        """{logger name: run id} recorded in the checkpoint, to continue."""
        runs = self.checkpoint.get(LOGGER_RUNS)
        return dict(runs) if isinstance(runs, dict) else {}

    def data_state(self, datamodule: L.LightningDataModule) -> dict[str, Any]:
        """The state `datamodule`'s class saved in the checkpoint (Lightning keeps it under the
        class's name), {} where there is none."""
        state = self.checkpoint.get(type(datamodule).__qualname__)
        return dict(state) if isinstance(state, dict) else {}


def open_resume(
    value: str | None, checkpoints_dir: Path, now: dict[str, Any], model: nn.Module, *,
    trust: bool = False, expected: str | None = None,
) -> ResumeSource | None:  # fmt: skip
    """The checkpoint `--resume_from_checkpoint` names, read and checked before training (None:
    a fresh start). A damaged file (`DamagedCheckpoint`), one that would run code
    (`UntrustedCheckpoint`), one that no ae run saved (`NotAnAeCheckpoint`) and one whose model
    these flags cannot build (`ResumeRefused`) are one message each, exit 2. `expected`: as for
    `resolve_resume`."""
    path = resolve_resume(value, checkpoints_dir, expected)
    if path is None:
        return None
    try:
        # Not just any torch file: another zip or pickle failed in torch's reader or in
        # Lightning's load, a traceback of each rank
        checkpoint = read_ae_checkpoint(path, trust=trust)
    except NotAnAeCheckpoint as e:
        raise NotAnAeCheckpoint(
            f"resume_from_checkpoint: {e}; it takes a checkpoint an ae run saved "
            "(<output_dir>/checkpoints/*.ckpt), or last"
        ) from None
    check_resume(path, checkpoint, now, model)
    return ResumeSource(path, checkpoint)


def nothing_left(path: Path, step: int, max_steps: int, max_epochs: int) -> str:
    """What to say when a resumed run trained no step: the checkpoint is at the run's end already
    (rightly so for a requeued job that had finished), and "Training finished" alone left a user
    who meant to train on wondering why nothing trained."""
    limit = f"--max_steps={max_steps}" if 0 <= max_steps <= step else f"--max_epochs={max_epochs}"
    return f"Nothing left to train: {path} is at step {step}, where {limit} ends the run; raise it"
