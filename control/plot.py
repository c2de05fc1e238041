"""`sigmaflight plot`: one PNG of a trajectory, drawn with Pillow (no matplotlib).

The PNG is always PLOT_WIDTH x PLOT_HEIGHT = 1200 x 400 pixels, three 400 x 400 panels:
  1. the sigma schedule sigmas[i] over the absolute index i = 0..T, stochastic transitions
     marked with a red dot at their start i;
  2. log_prob per transition i, one line per sample;
  3. the final latents x_T decoded through the model's VAE, as an image grid, when the
     metadata's model id is a built-in (tiny-sd3, small-sd3, tiny-flux) and x_T was
     streamed; otherwise the panel says why there is no image.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from PIL import Image, ImageDraw

from control.inspect import Report

PANEL = 400
PLOT_WIDTH = 3 * PANEL
PLOT_HEIGHT = PANEL
_MARGIN = (48, 28, 12, 34)  # left, top, right, bottom
_COLOURS = [(31, 119, 180), (255, 127, 14), (44, 160, 44), (214, 39, 40), (148, 103, 189),
            (140, 86, 75), (227, 119, 194), (127, 127, 127), (188, 189, 34), (23, 190, 207)]


def _frame(draw: ImageDraw.ImageDraw, x0: int, title: str, xs: tuple[float, float], ys: tuple[float, float],
           xlabel: str) -> Any:
    left, top, right, bottom = _MARGIN
    box = (x0 + left, top, x0 + PANEL - right, PANEL - bottom)
    draw.rectangle(box, outline=(0, 0, 0))
    draw.text((x0 + left, 6), title, fill=(0, 0, 0))
    draw.text((x0 + left, PANEL - bottom + 16), xlabel, fill=(0, 0, 0))
    x_lo, x_hi = xs
    y_lo, y_hi = ys
    if y_hi == y_lo:
        y_lo, y_hi = y_lo - 1.0, y_hi + 1.0
    if x_hi == x_lo:
        x_hi = x_lo + 1.0
    draw.text((x0 + 2, top), f"{y_hi:.3g}", fill=(0, 0, 0))
    draw.text((x0 + 2, PANEL - bottom - 10), f"{y_lo:.3g}", fill=(0, 0, 0))
    draw.text((box[0], PANEL - bottom + 3), f"{x_lo:g}", fill=(0, 0, 0))
    draw.text((box[2] - 16, PANEL - bottom + 3), f"{x_hi:g}", fill=(0, 0, 0))

    def to_px(x: float, y: float) -> tuple[float, float]:
        px = box[0] + 4 + (x - x_lo) / (x_hi - x_lo) * (box[2] - box[0] - 8)
        py = box[3] - 4 - (y - y_lo) / (y_hi - y_lo) * (box[3] - box[1] - 8)
        return px, py

    return to_px


def _schedule_panel(draw: ImageDraw.ImageDraw, rep: Report) -> None:
    sig = [r["sigma"] for r in rep.schedule]
    if not sig:
        draw.text((_MARGIN[0], PANEL // 2), "no sigmas in the metadata", fill=(0, 0, 0))
        return
    to_px = _frame(draw, 0, "sigma schedule (red: stochastic transition i)", (0, len(sig) - 1),
                   (min(0.0, min(sig)), max(sig)), "absolute step index i")
    pts = [to_px(i, s) for i, s in enumerate(sig)]
    if len(pts) > 1:
        draw.line(pts, fill=(0, 0, 0), width=2)
    for r, (px, py) in zip(rep.schedule, pts, strict=True):
        colour = (214, 39, 40) if r["sde"] else (90, 90, 90)
        rad = 4 if r["sde"] else 2
        draw.ellipse((px - rad, py - rad, px + rad, py + rad), fill=colour)


def _log_prob_panel(draw: ImageDraw.ImageDraw, rep: Report) -> None:
    x0 = PANEL
    m = rep.log_prob_matrix
    values = [v for per in m.values() for v in per.values() if math.isfinite(v)]
    if not values:
        draw.text((x0 + _MARGIN[0], PANEL // 2), "no log-probs in this trajectory", fill=(0, 0, 0))
        return
    t_count = max(len(rep.schedule) - 1, 1)
    to_px = _frame(draw, x0, "log_prob per transition, one line per sample", (0, t_count - 1),
                   (min(values), max(values)), "transition i")
    samples = sorted({s for per in m.values() for s in per})
    for k, sample in enumerate(samples):
        pts = [to_px(step, m[step][sample]) for step in sorted(m)
               if sample in m[step] and math.isfinite(m[step][sample])]
        colour = _COLOURS[k % len(_COLOURS)]
        if len(pts) > 1:
            draw.line(pts, fill=colour, width=1)
        for px, py in pts:
            draw.ellipse((px - 2, py - 2, px + 2, py + 2), fill=colour)


def decoded_images(path: str | Path, rep: Report) -> tuple[Any, str]:
    """(float images [B, 3, H, W] in [0, 1], "") or (None, why not)."""
    model_id = (rep.rollout.get("model") or {}).get("id")
    from pipeline.models import _BUILTINS

    if model_id not in _BUILTINS:
        return None, f"model {model_id!r} is not a built-in: no VAE to decode with"
    from dataplane.client import Trajectory
    from pipeline.decode import decode_latents
    from pipeline.models import ModelRegistry

    traj = Trajectory.from_file(path)
    if not traj.has_step(traj.num_steps):
        return None, f"x_T (step {traj.num_steps}) was not streamed"
    model = ModelRegistry().get(model_id)
    request = rep.rollout.get("request") or {}
    height = request.get("height") or model.defaults.height
    width = request.get("width") or model.defaults.width
    return decode_latents(model, traj.latent(traj.num_steps), height=height, width=width), ""


def _image_panel(canvas: Image.Image, draw: ImageDraw.ImageDraw, images: Any, why: str) -> None:
    x0 = 2 * PANEL
    draw.text((x0 + 8, 6), "final latents x_T decoded by the model's VAE", fill=(0, 0, 0))
    if images is None:
        draw.text((x0 + 8, PANEL // 2), why, fill=(0, 0, 0))
        return
    import numpy as np

    n = int(images.shape[0])
    cols = math.ceil(math.sqrt(n))
    rows = math.ceil(n / cols)
    cell = min((PANEL - 16) // cols, (PANEL - 32) // rows)
    arr = (images.permute(0, 2, 3, 1).numpy() * 255).round().astype(np.uint8)  # [B, H, W, 3]
    for k in range(n):
        tile = Image.fromarray(arr[k]).resize((cell - 4, cell - 4), Image.Resampling.NEAREST)
        canvas.paste(tile, (x0 + 8 + (k % cols) * cell, 24 + (k // cols) * cell))


def render_png(path: str | Path, rep: Report, out: str | Path, *, decode: bool = True) -> tuple[int, int]:
    """Write the PNG; returns its (width, height), always (PLOT_WIDTH, PLOT_HEIGHT)."""
    canvas = Image.new("RGB", (PLOT_WIDTH, PLOT_HEIGHT), (255, 255, 255))
    draw = ImageDraw.Draw(canvas)
    _schedule_panel(draw, rep)
    _log_prob_panel(draw, rep)
    images, why = decoded_images(path, rep) if decode else (None, "decoding switched off (--no-decode)")
    _image_panel(canvas, draw, images, why)
    canvas.save(out, format="PNG")
    return canvas.size
