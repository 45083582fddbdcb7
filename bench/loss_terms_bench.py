"""Cost per training step of each loss term of the latent-diffusion recipe, at 64 px: the pixel
loss alone, + LPIPS, + the adversarial terms (the generator's adaptive-weight term and the
discriminator's hinge step), and the adaptive weight computed ae's way (`generator_gradient`:
one backward per loss, to x_hat) against taming's (two autograd.grad passes through the whole
loss graph, then the full backward). Writes bench/results/loss_terms.json (`--quick`:
loss_terms_quick.json). `--fid`: also rFID's cost at validation (`--fid_weights`): the FID
Inception's features of a batch of images and of their reconstructions, per image, and the
distance computed from the epoch's sums (2048-d, once per rank per validation).

Each variant is a whole optimizer step (forward, backward, AdamW step of the autoencoder and, with
the discriminator, of it too). The variants run round-robin, one step each per round, so that a
busy machine slows them alike; the median per variant is reported, and the difference to the
pixel-only step is the term's cost. LPIPS weights are random (the cost does not depend on them).

    .venv/bin/python -m bench.loss_terms_bench --model=conv --batch_size=32 --rounds=15
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
from torch.nn import functional as F

from ae.training.adversarial import (
    NLayerDiscriminator,
    generator_gradient,
    hinge_d_loss,
    surrogate,
)
from ae.training.models.conv import conv_autoencoder
from ae.training.models.resnet import resnet_autoencoder
from ae.training.perceptual import LPIPS
from bench.common import write_record


def build(model: str) -> tuple[torch.nn.Module, torch.nn.Module, torch.Tensor]:
    """(encoder, decoder, the decoder's last layer weight) at 3x64x64."""
    if model == "conv":
        enc, dec = conv_autoencoder((3, 64, 64), 256, 16)
        last = [m for m in dec if isinstance(m, torch.nn.ConvTranspose2d)][-1].weight
    else:
        enc, dec = resnet_autoencoder(
            (3, 64, 64), downsample=8, base_channels=32, channel_mult=(1, 2, 4, 4),
            res_blocks=1, latent_channels=4,
        )  # fmt: skip
        last = dec[-1].weight
    return enc, dec, last


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", choices=["conv", "resnet"], default="conv")
    p.add_argument("--batch_size", type=int, default=32)
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--device", default="cpu")
    p.add_argument("--quick", action="store_true", help="batch 2, 1 round, 1 thread: a smoke run")
    p.add_argument("--fid", action="store_true", help="also rFID's cost per validation image")
    args = p.parse_args()
    if args.quick:
        args.batch_size, args.rounds, args.warmup = 2, 1, 0
        # on a shared 2-core CPU, torch's second thread spins against other processes
        torch.set_num_threads(1)
    torch.manual_seed(0)
    dev = torch.device(args.device)
    enc, dec, last = build(args.model)
    enc, dec = enc.to(dev), dec.to(dev)
    lpips = LPIPS().to(dev)
    disc = NLayerDiscriminator(3).to(dev)
    opt_g = torch.optim.AdamW([*enc.parameters(), *dec.parameters()], lr=1e-4)
    opt_d = torch.optim.Adam(disc.parameters(), lr=1e-4, betas=(0.5, 0.9))
    x = torch.rand(args.batch_size, 3, 64, 64, device=dev)

    def d_step(recon: torch.Tensor) -> torch.Tensor:
        return hinge_d_loss(disc(x), disc(recon.detach()))

    def pixel() -> None:
        recon = dec(enc(x))
        F.l1_loss(recon, x).backward()

    def with_lpips() -> None:
        recon = dec(enc(x))
        (F.l1_loss(recon, x) + lpips(recon, x).mean()).backward()

    def gan_ours(perceptual: bool) -> Callable[[], None]:
        def step() -> None:
            recon = dec(enc(x))
            nll = F.l1_loss(recon, x)
            if perceptual:
                nll = nll + lpips(recon, x).mean()
            out = generator_gradient(recon, nll, disc, last, 0.5)
            (surrogate(recon, out.grad) + d_step(recon)).backward()

        return step

    def gan_taming() -> None:
        recon = dec(enc(x))
        nll = (F.l1_loss(recon, x) + lpips(recon, x).mean()) * recon[0].numel()
        g_loss = -disc(recon).mean()
        a = torch.autograd.grad(nll, last, retain_graph=True)[0]
        b = torch.autograd.grad(g_loss, last, retain_graph=True)[0]
        w = (a.norm() / (b.norm() + 1e-4)).clamp(0, 1e4).detach() * 0.5
        # taming steps D in a second pass after the generator's; one backward of both here
        # costs the same work
        (nll + w * g_loss + d_step(recon)).backward()

    variants: dict[str, Callable[[], None]] = {
        "L1": pixel,
        "L1 + LPIPS": with_lpips,
        "L1 + GAN (G term + D step)": gan_ours(perceptual=False),
        "L1 + LPIPS + GAN, ae's adaptive weight": gan_ours(perceptual=True),
        "L1 + LPIPS + GAN, taming's adaptive weight": gan_taming,
    }
    times: dict[str, list[float]] = {k: [] for k in variants}
    for r in range(args.warmup + args.rounds):
        for name, fn in variants.items():
            t0 = time.perf_counter()
            fn()
            opt_g.step()
            opt_d.step()
            opt_g.zero_grad(set_to_none=True)
            opt_d.zero_grad(set_to_none=True)
            if dev.type == "cuda":
                torch.cuda.synchronize()
            if r >= args.warmup:
                times[name].append(time.perf_counter() - t0)
    with torch.no_grad():
        val = []
        for _ in range(args.rounds):
            t0 = time.perf_counter()
            lpips(dec(enc(x)), x)
            if dev.type == "cuda":
                torch.cuda.synchronize()
            val.append(time.perf_counter() - t0)
    params = sum(p.numel() for p in [*enc.parameters(), *dec.parameters()])
    print(
        f"model={args.model} ({params:,} params) batch={args.batch_size} 64px "
        f"device={args.device} threads={torch.get_num_threads()} rounds={args.rounds}"
    )
    base = statistics.median(times["L1"])
    print("| step | median ms | vs L1 |\n|---|---:|---:|")
    for name, ts in times.items():
        med = statistics.median(ts)
        print(f"| {name} | {med * 1e3:.0f} | {med / base:.2f}x |")
    val_ms = statistics.median(val) * 1e3
    print(f"| validation: forward + LPIPS metric, no grad | {val_ms:.0f} | |")
    rows = [
        {"step": name, "median_ms": statistics.median(ts) * 1e3,
         "vs_l1": statistics.median(ts) / base}
        for name, ts in times.items()
    ]  # fmt: skip
    record = {"model": args.model, "batch_size": args.batch_size, "rows": rows,
              "validation_ms": val_ms}  # fmt: skip
    if args.fid:
        record |= fid_cost(x, lambda: dec(enc(x)), args.rounds, dev)
    print(f"wrote {write_record('loss_terms', record, quick=args.quick)}")


def fid_cost(
    x: torch.Tensor, reconstruct: Callable[[], torch.Tensor], rounds: int, dev: torch.device
) -> dict[str, float]:
    """rFID's work at validation, as `QualityMetrics` does it: the Inception on the batch and
    its clamped reconstruction (ms per validation image, the pair), and the distance from the
    sums (ms, once per validation)."""
    # here, not at the top: torchmetrics (and matplotlib) cost ~1 s of CPU to import, for --fid only
    from ae.training.frechet import FrechetDistance
    from ae.training.inception import FIDInception

    inception = FIDInception().to(dev)  # random weights: the cost does not depend on them
    metric = FrechetDistance().to(dev)
    per_image = []
    with torch.no_grad():
        for _ in range(rounds):
            recon = reconstruct().clamp(0, 1)
            t0 = time.perf_counter()
            real, fake = inception(torch.cat([x, recon])).chunk(2)
            metric.update(real, fake)
            if dev.type == "cuda":
                torch.cuda.synchronize()
            per_image.append((time.perf_counter() - t0) / x.shape[0])
    t0 = time.perf_counter()
    metric.compute()
    distance_ms = (time.perf_counter() - t0) * 1e3
    image_ms = statistics.median(per_image) * 1e3
    print(f"| validation: rFID Inception features, per image and its reconstruction | "
          f"{image_ms:.0f} | |")  # fmt: skip
    print(
        f"| validation end: rFID distance from the sums (2048-d, float64) | {distance_ms:.0f} | |"
    )
    return {"rfid_ms_per_image": image_ms, "rfid_distance_ms": distance_ms}


if __name__ == "__main__":
    main()
