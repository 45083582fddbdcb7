"""The latent-diffusion recipe through Lightning's real loop (CPU, one process): the
discriminator frozen before --disc_start and trained after, one optimizer step per batch, the
per-rank stats, exact resume of both parameter groups, val/lpips; and the checks of the recipe's
inputs."""

from __future__ import annotations

import json
from pathlib import Path

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader

from ae.config import ModelConfig, ObjectiveConfig, OptimConfig
from ae.data.decoding.decode import InputSpec
from ae.training.lr import DiscSchedule
from ae.training.model import AutoEncoder
from ae.training.model_build import build_model
from ae.training.models import ModelError
from ae.training.objective import load_perceptual
from ae.training.position.model_fit import incompatible
from ae.training.startup_header import describe
from tests.support.weights import random_heads, random_vgg16, save

SPEC = InputSpec("image", (3, 32, 32))
START = 2  # --disc_start


@pytest.fixture(scope="module")
def weights(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("weights")
    save(random_vgg16(), folder / "vgg16-397923af.pth")
    save(random_heads(), folder / "vgg.pth")
    return folder


def objective(weights: Path, **kw: object) -> ObjectiveConfig:
    settings = {"perceptual_weight": 1.0, "perceptual_weights": str(weights),
                "disc_weight": 0.5, "disc_start": START, "disc_channels": 8, **kw}  # fmt: skip
    return ObjectiveConfig(**settings)  # type: ignore[arg-type]


def model(weights: Path, **kw: object) -> AutoEncoder:
    torch.manual_seed(0)
    m = AutoEncoder(
        SPEC, ModelConfig(model="conv", hidden_dim=16, latent_dim=8, loss="l1"),
        OptimConfig(learning_rate=1e-3, warmup_steps=0, lr_scale="none", lr_scheduler="constant"),
        objective=objective(weights, **kw),
    )  # fmt: skip
    lpips = load_perceptual(m.recipe.cfg)
    assert lpips is not None
    m.attach_perceptual(lpips)
    return m


def batches() -> DataLoader:
    images = torch.rand(16, *SPEC.shape, generator=torch.Generator().manual_seed(1))
    return DataLoader(images, batch_size=4)


class Recorder(L.Callback):
    """The discriminator's first conv and the logged values after each optimizer step."""

    def __init__(self) -> None:
        self.d: dict[int, torch.Tensor] = {}
        self.logged: dict[int, dict[str, float]] = {}

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, idx) -> None:
        self.d[trainer.global_step] = pl_module.discriminator.main[0].weight.detach().clone()
        self.logged[trainer.global_step] = {
            k: float(v) for k, v in trainer.callback_metrics.items()
        }


def trainer(steps: int, callbacks: list[L.Callback] | None = None) -> L.Trainer:
    return L.Trainer(
        max_steps=steps, accelerator="cpu", logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, log_every_n_steps=1,
        callbacks=callbacks or [], num_sanity_val_steps=0, limit_val_batches=1,
        gradient_clip_val=1.0,
    )  # fmt: skip


def test_the_discriminator_starts_at_disc_start(weights: Path, tmp_path: Path) -> None:
    m = model(weights)
    m.recipe.stats_file = tmp_path / "gan_rank0_TS.json"
    before = m.discriminator.main[0].weight.detach().clone()
    rec = Recorder()
    t = trainer(4, [rec])
    t.fit(m, batches())
    assert t.global_step == 4  # one optimizer step per batch, discriminator and all
    assert torch.equal(rec.d[1], before) and torch.equal(rec.d[START], before)
    assert not torch.equal(rec.d[4], before)
    # before disc_start nothing adversarial is logged; from it, every term
    assert "train/g_loss" not in rec.logged[1] and "train/perceptual" in rec.logged[1]
    for key in ("g_loss", "d_loss", "d_weight", "logits_real", "logits_fake", "d_accuracy"):
        assert key in {k.split("/")[1] for k in rec.logged[4]}, key
    assert 0 <= rec.logged[4]["train/d_accuracy"] <= 1
    # this rank's stats file, for rank 0's per-rank series
    record = json.loads(m.recipe.stats_file.read_text())
    assert record["rank"] == 0 and record["step"] == 3
    assert set(record) >= {"logits_real", "logits_fake", "d_accuracy", "d_weight"}
    opt = t.optimizers[0]
    d_group = opt.param_groups[-1]
    assert d_group["name"] == "discriminator" and d_group["betas"] == (0.5, 0.9)
    assert d_group["weight_decay"] == 0.0 and opt.param_groups[0]["betas"] == (0.9, 0.999)
    schedules = t.lr_scheduler_configs[0].scheduler.lr_lambdas
    assert isinstance(schedules[-1], DiscSchedule) and schedules[-1](START - 1) == 0.0
    assert schedules[-1](START) == schedules[0](START) > 0  # then the generator's schedule
    # validation: val/lpips beside PSNR and SSIM
    (metrics,) = t.validate(m, batches(), verbose=False)
    assert {"val/lpips", "val/psnr", "val/ssim", "val/loss"} <= set(metrics)
    assert metrics["val/lpips"] > 0


def test_a_checkpoint_restores_both_groups(weights: Path, tmp_path: Path) -> None:
    """Lightning's own restore of the one optimizer: both networks' weights and both groups'
    Adam moments come back exactly (the runs resumed through the launcher, with ae's data
    position, are tests/e2e/test_image_recipe.py's)."""
    part = model(weights)
    t = trainer(4)
    t.fit(part, batches())  # past disc_start: the discriminator's Adam moments exist
    ckpt = tmp_path / "step4.ckpt"
    t.save_checkpoint(ckpt)
    resumed = model(weights, disc_start=0)  # restored from the file, not from these settings
    t2 = trainer(4)  # restores, then stops: max_steps reached
    t2.fit(resumed, batches(), ckpt_path=ckpt, weights_only=False)
    assert t2.global_step == 4
    for (k, a), b in zip(part.state_dict().items(), resumed.state_dict().values(), strict=True):
        assert torch.equal(a, b), k
    opt_a, opt_b = t.optimizers[0], t2.optimizers[0]
    assert [g["name"] for g in opt_b.param_groups] == [g["name"] for g in opt_a.param_groups]
    for ga, gb in zip(opt_a.param_groups, opt_b.param_groups, strict=True):
        for pa, pb in zip(ga["params"], gb["params"], strict=True):
            for key in ("exp_avg", "exp_avg_sq", "step"):
                assert torch.equal(opt_a.state[pa][key], opt_b.state[pb][key]), (ga["name"], key)
    d_moment = opt_a.state[opt_a.param_groups[-1]["params"][0]]["exp_avg"]
    assert d_moment.abs().sum() > 0  # the discriminator did train


def test_resume_turning_the_discriminator_on_is_refused_by_name(weights: Path) -> None:
    without = AutoEncoder(SPEC, ModelConfig(model="conv", hidden_dim=16, latent_dim=8))
    problems = incompatible(
        {"disc_weight": 0.0}, {"disc_weight": 0.5}, without.state_dict(), model(weights)
    )
    assert len(problems) == 1 and problems[0].startswith("disc_weight: 0.0 -> 0.5")
    assert "cannot be added" in problems[0]


def test_describe_names_the_recipe(weights: Path) -> None:
    m = model(weights)
    text = describe(m, SPEC, (8,))
    assert f"PatchGAN discriminator ({sum(p.numel() for p in m.discriminator.parameters()):,}" in (
        text
    )
    assert "LPIPS (perceptual_weight 1)" in text and f"from step {START}" in text
    # ae-encode's line: the model that encodes, not the losses that trained it
    assert describe(m, SPEC, (8,), training=False) == text.split(", LPIPS")[0]


def test_the_recipe_needs_images_large_enough() -> None:
    optim = OptimConfig()
    with pytest.raises(ModelError, match="perceptual_weight: the perceptual and adversarial"):
        build_model(InputSpec("vector", (16,)), ModelConfig(), optim, 1,
                    objective=ObjectiveConfig(perceptual_weight=1.0))  # fmt: skip
    with pytest.raises(ModelError, match="LPIPS needs images of at least 16 px; these are 8x8"):
        build_model(InputSpec("image", (3, 8, 8)), ModelConfig(), optim, 1,
                    objective=ObjectiveConfig(perceptual_weight=1.0))  # fmt: skip
    with pytest.raises(ModelError, match="3-layer discriminator needs images of at least 24 px"):
        build_model(InputSpec("image", (3, 16, 16)), ModelConfig(), optim, 1,
                    objective=ObjectiveConfig(disc_weight=0.5))  # fmt: skip


class NoDecoder(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = torch.nn.Conv2d(3, 3, 1)

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)

    def decode(self, z: torch.Tensor) -> torch.Tensor:
        return z


def test_a_user_model_without_a_last_layer_is_told_how() -> None:
    with pytest.raises(ModelError, match=r"give your class a last_layer\(\) method"):
        AutoEncoder(SPEC, net=NoDecoder(), objective=ObjectiveConfig(disc_weight=0.5))


def test_the_documented_recipe_file_parses() -> None:
    from ae.config import parse_config
    from tests.support.runs import ROOT

    cfg = parse_config([f"--config={ROOT / 'docs' / 'autoencoder_kl_f8.yaml'}"])
    assert (cfg.objective.perceptual_weight, cfg.objective.disc_weight) == (1.0, 0.5)
    assert cfg.objective.disc_start == 50001 and cfg.model.kl_weight == pytest.approx(
        1e-6 / 48, 0.01
    )
    assert cfg.optim.learning_rate == pytest.approx(4.5e-6 * 12 * 2)
