"""`--ema_decay`: an exponential moving average of the weights, with Lightning's own callback.

Lightning's `EMAWeightAveraging` updates the average after every optimizer step, swaps it in for
validation, saves it as the checkpoint's `state_dict` (the live weights go to
`current_model_state`, so a resumed run continues both) and copies it into the model when
training ends. `ae-encode` loads `state_dict`, hence the EMA weights when there are any.
Reconstruction grids use the average too (`averaged`).
"""

from __future__ import annotations

import lightning as L
from lightning.pytorch.callbacks import EMAWeightAveraging


class EMA(EMAWeightAveraging):
    def __init__(self, decay: float) -> None:
        super().__init__(decay=decay)

    def averaged(self) -> L.LightningModule | None:
        """The averaged copy of the module (None before fit has set it up)."""
        return None if self._average_model is None else self._average_model.module


def averaged_module(trainer: L.Trainer, pl_module: L.LightningModule) -> L.LightningModule:
    """The weights to show and use: the EMA's when the run keeps one, else the module itself."""
    for callback in getattr(trainer, "callbacks", []):
        if isinstance(callback, EMA) and (avg := callback.averaged()) is not None:
            return avg
    return pl_module
