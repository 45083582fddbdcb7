"""Validation quality of the reconstructions, accumulated over the epoch by torchmetrics.

Images: `val/psnr` and `val/ssim` (torchmetrics, data range 1: the inputs are in [0, 1], and the
reconstructions are clamped to it first, as an image viewer would). Vectors: `val/rel_error`, the
mean over samples of |x_hat - x| / |x|, and `val/cosine`, the mean cosine similarity of x_hat to x.
Both kinds also get `val/mse`, comparable across `--loss` choices. With LPIPS loaded
(`--perceptual_weight` > 0: `attach_lpips`), images also get `val/lpips`, the mean over samples
of the clamped reconstruction's LPIPS to its input. With `--fid_weights` (`attach_fid`), images
also get `val/rfid`: the Frechet distance between the FID Inception features of the validation
images and of their clamped reconstructions (`ae.training.frechet`), over the whole validation
set, every rank's images included.

Every state is a running sum (no per-sample lists), so memory stays constant however long the
validation set is; torchmetrics syncs the sums across ranks when the epoch's value is computed.
The states are not part of the model's state dict.

The validation images are the same at every validation (center crops of a fixed set), so their
Inception features, half of rFID's cost (an Inception pass at 299 x 299 per image), are computed
at the first and kept, keyed by each batch's bytes (a batch that differs in any bit is computed
again), for up to `KEPT_REAL_FEATURES` images (8 KB each).
"""

from __future__ import annotations

import hashlib

import lightning as L
import torch
from torch import nn
from torch.nn import functional as F
from torchmetrics import MeanMetric, MeanSquaredError
from torchmetrics.image import PeakSignalNoiseRatio, StructuralSimilarityIndexMeasure

from ae.data.decoding.decode import InputSpec
from ae.training.frechet import FrechetDistance
from ae.training.inception import FEATURES
from ae.training.perceptual import SharedNet

# Validation images whose Inception features are kept from one validation to the next (2048
# float32 each: 128 MB on the device at most); the images beyond are computed at each one.
KEPT_REAL_FEATURES = 16_384
# What validation logs as `val/<name>`, by input kind (besides `val/loss`).
METRIC_NAMES = {"image": ("mse", "psnr", "ssim"), "vector": ("mse", "rel_error", "cosine")}


def ssim_kernel(height: int, width: int) -> int:
    """SSIM's usual 11x11 window, smaller for images under 6 px (its reflect padding must stay
    below the image size)."""
    size = min(11, 2 * min(height, width) - 1)
    return size if size % 2 else size - 1


class QualityMetrics(nn.Module):
    def __init__(self, spec: InputSpec) -> None:
        super().__init__()
        self.images = spec.kind == "image"
        self.mse = MeanSquaredError()
        if self.images:
            _, h, w = spec.shape
            self.psnr = PeakSignalNoiseRatio(data_range=1.0)
            self.ssim = StructuralSimilarityIndexMeasure(
                data_range=1.0, kernel_size=ssim_kernel(h, w)
            )
        else:
            self.rel_error = MeanMetric()
            self.cosine = MeanMetric()
        self.lpips_net: SharedNet | None = None
        self.fid_net: SharedNet | None = None
        # The validation images' Inception features by their batch's digest (`_update_rfid`).
        self._kept_real: dict[bytes, torch.Tensor] = {}
        self._kept_images = 0

    def attach_lpips(self, net: SharedNet) -> None:
        self.lpips_net = net
        self.lpips = MeanMetric()

    def attach_fid(self, net: SharedNet, features: int = FEATURES) -> None:
        self.fid_net = net
        self.rfid = FrechetDistance(features)

    @torch.no_grad()
    def update(self, recon: torch.Tensor, x: torch.Tensor) -> None:
        # A user model may return any float dtype, channels-last or strided (non-contiguous)
        # tensors; torchmetrics `.view`s its inputs, which needs a contiguous layout.
        recon, x = recon.float().contiguous(), x.float().contiguous()
        self.mse.update(recon, x)
        if self.images:
            clamped = recon.clamp(0.0, 1.0)
            self.psnr.update(clamped, x)
            self.ssim.update(clamped, x)
            if self.lpips_net is not None:
                self.lpips.update(self.lpips_net(clamped, x))
            if self.fid_net is not None:
                self._update_rfid(x, clamped)
        else:
            flat_r, flat_x = recon.flatten(1), x.flatten(1)
            err = (flat_r - flat_x).norm(dim=1) / flat_x.norm(dim=1).clamp_min(1e-12)
            self.rel_error.update(err)
            self.cosine.update(F.cosine_similarity(flat_r, flat_x, dim=1))

    def _update_rfid(self, x: torch.Tensor, clamped: torch.Tensor) -> None:
        """The batch's features into rFID: the images' own kept from an earlier validation when
        the batch is the same to the last bit (its digest: one host copy of the batch, at
        validation only), else computed with the reconstructions' in one pass and kept."""
        assert self.fid_net is not None
        key = hashlib.blake2b(x.detach().cpu().numpy(), digest_size=16).digest()  # contiguous
        real = self._kept_real.get(key)
        if real is not None:
            fake = self.fid_net(clamped)
        else:
            real, fake = self.fid_net(torch.cat([x, clamped])).chunk(2)
            if self._kept_images + len(x) <= KEPT_REAL_FEATURES:
                self._kept_real[key] = real
                self._kept_images += len(x)
        self.rfid.update(real, fake)

    def log_to(self, module: L.LightningModule) -> None:
        """Log the metric objects: Lightning computes (synced) and resets them at epoch end."""
        names = METRIC_NAMES["image" if self.images else "vector"]
        names += ("lpips",) if self.lpips_net is not None else ()
        names += ("rfid",) if self.fid_net is not None else ()
        for name in names:
            module.log(f"val/{name}", getattr(self, name), on_step=False, on_epoch=True)
