"""The lines of a run's numerical health, defined once (re-exported by `ae.log_lines`, where
readers find every format): non-finite losses and gradients, what each rank did about them, loss
spikes (ae.training.nonfinite), and the adversarial recipe's per-rank statistics
(ae.training.objective)."""

from __future__ import annotations

from logging_cfg.formats import LineFormat

# --- non-finite values (ae.training.nonfinite) ---------------------------------------------
# The first non-finite value of a step on the rank whose own loss or gradient (before the
# all-reduce) held it, ERROR, once per such step. `value`: `loss=nan`, `loss=inf`, or
# `gradient=nan in <parameter>` (the first parameter, in the model's order, whose reduced gradient
# is not finite; `gradient=nan` when the step is known only later); `samples`: `shard <url>, keys
# [k, ...]` for each shard of the batch, NONFINITE_INPUT after the keys whose decoded sample
# holds a NaN or Inf (those alone are named when there are any). Only such a line is a data
# error (ae-diagnose): a non-finite loss of finite inputs names the batch's shards without
# blaming them.
NONFINITE_INPUT = "(non-finite input)"
NONFINITE = LineFormat(
    "NONFINITE {value} on rank {rank} at step {step} (epoch {epoch}, batch {batch}): {samples}",
    {"value": "text", "rank": "int", "step": "int", "epoch": "int", "batch": "text",
     "samples": "text"},
)  # fmt: skip
# The ranks whose own values were finite: the reduced gradient was not (another rank's value).
NONFINITE_RECEIVED = LineFormat(
    "Non-finite gradient after the all-reduce at step {step}: this rank's loss and gradient were "
    "finite (another rank's NONFINITE line names the cause)",
    {"step": "int"},
)
# What every rank did about it, `--on_nonfinite`: each line once per non-finite step.
NONFINITE_SKIPPED = LineFormat(
    "SKIPPED optimizer step {step} on every rank (non-finite gradient): {skipped} of at most "
    "{limit} skipped",
    {"step": "int", "skipped": "int", "limit": "int"},
)
ROLLBACK = LineFormat(
    "ROLLBACK at step {step}: weights and optimizer state back to {path} (step {to}); the "
    "batches of the steps after it are not trained again ({count} of at most {limit})",
    {"step": "int", "path": "text", "to": "int", "count": "int", "limit": "int"},
)
NONFINITE_STOP = LineFormat(
    "Stopping at step {step}: non-finite value (--on_nonfinite={mode}); no checkpoint is written "
    "after it; newest finite checkpoint: {checkpoint}",
    {"step": "int", "mode": "word", "checkpoint": "text"},
)
# At the end of a run that survived non-finite steps (rank 0, train log and console).
NONFINITE_SUMMARY = LineFormat(
    "Non-finite steps survived: {skipped} skipped, {rollbacks} rolled back (--on_nonfinite={mode})",
    {"skipped": "int", "rollbacks": "int", "mode": "word"},
)
# A save refused because the state holds a non-finite value (the save guard); every rank.
CHECKPOINT_REFUSED = LineFormat(
    "Checkpoint not written at step {step} ({reason}): non-finite values in {what}",
    {"step": "int", "reason": "text", "what": "text"},
)
# A finite loss far above its recent values (`ae.training.nonfinite.SPIKE_FACTOR`), WARNING.
LOSS_SPIKE = LineFormat(
    "LOSS SPIKE loss={loss} on rank {rank} at step {step} (epoch {epoch}, batch {batch}), "
    "{ratio}x its recent mean {mean}: {samples}",
    {"loss": "float", "rank": "int", "step": "int", "epoch": "int", "batch": "text",
     "ratio": "float", "mean": "float", "samples": "text"},
)  # fmt: skip

# The latent-diffusion recipe (ae.training.objective), every rank in its own log, on the loggers'
# cadence once the discriminator runs: its mean logit on real and reconstructed images, its
# accuracy over patches, the adaptive weight (taming's scale, x --disc_weight), both losses.
GAN_STATS = LineFormat(
    "GAN step {step}: d_real={d_real} d_fake={d_fake} d_acc={d_acc} d_weight={d_weight} "
    "g_loss={g_loss} d_loss={d_loss}",
    {"step": "int", "d_real": "float", "d_fake": "float", "d_acc": "float", "d_weight": "float",
     "g_loss": "float", "d_loss": "float"},
)  # fmt: skip
# A WARNING of the rank's watch (ae.training.adversarial.GanWatch): discriminator accuracy 1.0 or
# the adaptive weight at its clamp for WATCH_POINTS logged steps, a non-finite value, or the end
# of such an episode.
GAN_WARNING = LineFormat("GAN warning step {step}: {what}", {"step": "int", "what": "text"})
# Each rank's latest GAN_STATS as JSON in the logs folder ({"rank", "step", and the six values
# under GanStats' names}), rewritten on the cadence: rank 0 reads them into the loggers'
# `gan/<name>/rank<N>` series (ae.training.rank_series), without a collective.
GAN_STATS_FILE = LineFormat("gan_rank{rank}_{ts}.json", {"rank": "int"})
