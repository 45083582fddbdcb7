"""PNG pictures with Pillow alone: reconstruction grids and loss curves (no matplotlib needed)."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw

from ae.training.checkpoint_files import atomic_write

_BG = (255, 255, 255)
_INK = (40, 40, 40)
_GRID = (225, 225, 225)
_COLORS = [(31, 119, 180), (255, 127, 14), (44, 160, 44), (214, 39, 40)]


def to_image(array: np.ndarray) -> Image.Image:
    """(C, H, W) floats in [0, 1] -> an RGB image (1 channel: gray; more than 3: the first 3)."""
    data = (np.clip(array, 0.0, 1.0) * 255).round().astype(np.uint8)
    if data.shape[0] == 1:
        return Image.fromarray(data[0], "L").convert("RGB")
    return Image.fromarray(np.ascontiguousarray(data[:3].transpose(1, 2, 0)), "RGB")


def reconstruction_grid(
    inputs: np.ndarray, outputs: np.ndarray, path: Path, per_row: int = 8, tile: int = 64
) -> None:
    """Inputs (N, C, H, W) in a row, their reconstructions in the row below, `per_row` per
    pair of rows. Small images are scaled up (nearest neighbour) to about `tile` pixels."""
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
    atomic_write(path, lambda f: canvas.save(f, format="PNG"), what="sample grid")


def line_plot(
    series: dict[str, list[tuple[float, float]]],
    path: Path,
    title: str,
    size: tuple[int, int] = (720, 420),
) -> None:
    """Lines of (x, y) points, y on a log scale when all y are positive (losses span decades)."""
    points = [p for pts in series.values() for p in pts if math.isfinite(p[1])]
    if not points:
        return
    log_y = all(y > 0 for _, y in points)

    def fy(y: float) -> float:
        return math.log10(y) if log_y else y

    x0, x1 = min(x for x, _ in points), max(x for x, _ in points)
    y0, y1 = min(fy(y) for _, y in points), max(fy(y) for _, y in points)
    x1, y1 = (x1 if x1 > x0 else x0 + 1), (y1 if y1 > y0 else y0 + 1)
    width, height = size
    left, right, top, bottom = 70, 20, 30, 40
    pw, ph = width - left - right, height - top - bottom
    img = Image.new("RGB", size, _BG)
    draw = ImageDraw.Draw(img)

    def px(x: float, y: float) -> tuple[float, float]:
        return left + (x - x0) / (x1 - x0) * pw, top + (1 - (fy(y) - y0) / (y1 - y0)) * ph

    for i in range(5):  # grid lines with labels
        fy_tick = y0 + (y1 - y0) * i / 4
        ty = top + (1 - i / 4) * ph
        draw.line([(left, ty), (left + pw, ty)], fill=_GRID)
        label = f"{10**fy_tick:.3g}" if log_y else f"{fy_tick:.3g}"
        draw.text((4, ty - 6), label, fill=_INK)
        tx = left + pw * i / 4
        draw.line([(tx, top), (tx, top + ph)], fill=_GRID)
        draw.text((tx - 10, top + ph + 6), f"{x0 + (x1 - x0) * i / 4:.5g}", fill=_INK)
    draw.rectangle([left, top, left + pw, top + ph], outline=_INK)
    draw.text((left, 8), title, fill=_INK)
    draw.text((left + pw - 30, top + ph + 22), "step", fill=_INK)
    for k, (name, pts) in enumerate(series.items()):
        color = _COLORS[k % len(_COLORS)]
        xy = [px(x, y) for x, y in pts if math.isfinite(y)]
        if len(xy) > 1:
            draw.line(xy, fill=color, width=2)
        for cx, cy in xy if len(xy) < 60 else []:
            draw.ellipse([cx - 2, cy - 2, cx + 2, cy + 2], fill=color)
        ly = top + 14 + 14 * k
        draw.line([(left + pw - 160, ly), (left + pw - 140, ly)], fill=color, width=2)
        draw.text((left + pw - 135, ly - 6), name, fill=color)
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(path, lambda f: img.save(f, format="PNG"), what="loss curve")
