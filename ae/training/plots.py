"""PNG pictures: reconstruction grids (Pillow: pixels pasted side by side) and the loss curve
(matplotlib: axes, ticks and legend)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
from PIL import Image, ImageDraw

from ae import atomic_files

if TYPE_CHECKING:  # matplotlib is imported where a curve is drawn, not with this module
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

_BG = (255, 255, 255)
_INK = (40, 40, 40)


def to_image(array: np.ndarray) -> Image.Image:
    """(C, H, W) floats in [0, 1] -> an RGB image (1 channel: gray; more than 3: the first 3)."""
    data = (np.clip(array, 0.0, 1.0) * 255).round().astype(np.uint8)
    if data.shape[0] == 1:
        return Image.fromarray(data[0], "L").convert("RGB")
    return Image.fromarray(np.ascontiguousarray(data[:3].transpose(1, 2, 0)), "RGB")


def reconstruction_grid(
    inputs: np.ndarray, outputs: np.ndarray, path: Path, per_row: int = 8, tile: int = 64
) -> Image.Image:
    """Inputs (N, C, H, W) in a row, their reconstructions in the row below, `per_row` per
    pair of rows. Small images are scaled up (nearest neighbour) to about `tile` pixels.
    Written to `path`, and returned (for the loggers)."""
    n, _, h, w = inputs.shape
    scale = max(1, tile // max(h, w))
    th, tw, gap, label_w = h * scale, w * scale, 4, 34
    cols = min(per_row, n)
    groups = math.ceil(n / cols)
    pair_h = 2 * th + 3 * gap
    canvas = Image.new("RGB", (label_w + cols * (tw + gap) + gap, groups * pair_h + gap), _BG)
    draw = ImageDraw.Draw(canvas)
    for g in range(groups):
        y = gap + g * pair_h
        draw.text((4, y + th // 2 - 5), "input", fill=_INK)
        draw.text((4, y + th + gap + th // 2 - 5), "recon", fill=_INK)
    for i in range(n):
        g, col = divmod(i, cols)
        x, y = label_w + gap + col * (tw + gap), gap + g * pair_h
        canvas.paste(to_image(inputs[i]).resize((tw, th), Image.NEAREST), (x, y))
        canvas.paste(to_image(outputs[i]).resize((tw, th), Image.NEAREST), (x, y + th + gap))
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_files.write(path, lambda f: canvas.save(f, format="PNG"), what="sample grid")
    return canvas


# What each kind of step mark looks like on the loss curve: (colour, line style).
_MARK_STYLE = {"loss spike": ("#d35400", "--"), "non-finite": ("#b30000", ":")}


def _epoch_ticks(
    epoch_ends: Sequence[tuple[float, int]], most: int = 12
) -> list[tuple[float, int]]:
    """(step, epochs done) of the epoch ends to mark: every one while they are few, else every
    2nd, 5th, 10th, 20th, ... epoch, at most `most` of them."""
    done = [(step, epoch + 1) for step, epoch in epoch_ends]
    every = next(k for k in (1, 2, 5, 10, 20, 50, 100, 200, 500, 10**9)
                 if sum(1 for _, n in done if n % k == 0) <= most)  # fmt: skip
    return [(step, n) for step, n in done if n % every == 0]


def loss_plot(
    series: dict[str, list[tuple[float, float]]],
    path: Path,
    marks: Sequence[tuple[int, str]] = (),
    epoch_ends: Sequence[tuple[float, int]] = (),
) -> Figure | None:
    """Lines of (step, loss) points against the optimizer step, on a log scale when every value
    is positive (losses span decades); each point marked while a line has few of them. `marks`:
    (step, `loss spike` | `non-finite`), each a vertical line (`ae.training.nonfinite`).
    `epoch_ends`: (step, epoch) where each epoch ended, marked on a top axis of epochs done.
    Returns the figure written (None: no finite point to draw)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg  # only where a curve is drawn
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    finite = {name: [(x, y) for x, y in pts if math.isfinite(y)] for name, pts in series.items()}
    finite = {name: pts for name, pts in finite.items() if pts}
    if not finite:
        return None
    fig = Figure(figsize=(7.2, 4.2), dpi=100, layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    for name, pts in finite.items():
        xs, ys = zip(*pts, strict=True)
        ax.plot(xs, ys, label=name, linewidth=1.6, marker="o" if len(pts) < 60 else None,
                markersize=3)  # fmt: skip
    labelled: set[str] = set()
    for step, what in marks:
        colour, style = _MARK_STYLE.get(what, ("#555555", ":"))
        label = what if what not in labelled else None
        labelled.add(what)
        ax.axvline(step, color=colour, linestyle=style, linewidth=1.2, label=label)
    log_y = all(y > 0 for pts in finite.values() for _, y in pts)
    if log_y:
        log_y_axis(ax, [y for pts in finite.values() for _, y in pts])
    ax.set_ylabel("loss (log scale)" if log_y else "loss")
    ax.set_xlabel("optimizer steps done")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # steps are whole: no 35.25
    ax.grid(True, which="major", alpha=0.35)
    ax.grid(True, which="minor", alpha=0.12)
    if ticks := _epoch_ticks(epoch_ends):
        ax.grid(False, axis="x", which="both")  # the epoch ends are the vertical lines: a step
        for step, _ in ticks:  # grid line beside each (45 by 46) only doubled them
            ax.axvline(step, color="#888888", linewidth=0.7, alpha=0.35, zorder=0)
        top = ax.secondary_xaxis("top")
        top.set_xticks([step for step, _ in ticks], labels=[str(n) for _, n in ticks])
        top.set_xlabel("epochs done", fontsize=9)
        top.tick_params(labelsize=8)
    ax.set_title("loss vs optimizer step")
    ax.legend(loc="best")  # not over the newest points, where a fixed corner can fall
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_files.write(path, lambda f: fig.savefig(f, format="png"), what="loss curve")
    return fig


def log_y_axis(ax: Axes, values: list[float]) -> None:
    """A log y axis labelled in plain numbers (0.15, not 1.5x10^-1), with labels enough for the
    range of `values` (all positive)."""
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    ax.set_yscale("log")
    plain = FuncFormatter(lambda v, _: f"{v:.3g}")
    ax.yaxis.set_major_formatter(plain)
    span = math.log10(max(values) / min(values))
    # Up to 1.5 decades every minor tick is labelled, up to 3 those at 2x and 5x (0.02, 0.05,
    # 0.2), past that only the decades.
    two_five = FuncFormatter(lambda v, _: f"{v:.3g}" if f"{v:.0e}"[0] in "25" else "")
    minor = plain if span < 1.5 else two_five if span < 3 else NullFormatter()
    ax.yaxis.set_minor_formatter(minor)
    if span < 1.0:
        # Under a decade the 2x..9x ticks can leave a stretch bare (0.065-0.17, 0.03-0.19:
        # none above 0.1): 1.2x, 1.5x and 2.5x fill it.
        ax.yaxis.set_minor_locator(LogLocator(subs=(1.2, 1.5, 2, 2.5, 3, 4, 5, 6, 7, 8, 9)))
