"""`sigmaflight plot`: one PNG of a trajectory, drawn with matplotlib (Agg, no display).

Layout (PLOT_WIDTH x PLOT_HEIGHT pixels at DPI):
  top left:  the sigma schedule, sigma_i over the absolute step index i = 0..T, stochastic
             transitions marked (red) and told apart in the legend;
  top right: log_prob per transition i, one line per sample (a legend entry each) or, with
             more than MAX_SAMPLE_LEGEND samples, one colour and legend entry per prompt (the first
             MAX_PROMPT_LEGEND - 1 of them and "... N more prompts" past MAX_PROMPT_LEGEND);
  bottom:    the final latents x_T decoded through the model's own VAE (sigmaflight.pipeline.decode,
             every family: images, or frames of a video), one column per sample with the
             sample's prompt under it. When it cannot decode (x_T not streamed, the model
             not available here, --no-decode) the panel says why.

The model is a built-in by the id in the metadata, or the pipeline in `model_dir` (a
`--model-dir` directory, as `sigmaflight serve --model-dir` loads it).
"""

from __future__ import annotations

import math
import textwrap
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from sigmaflight.report import Report

__all__ = ["DPI", "PLOT_HEIGHT", "PLOT_WIDTH", "Decoded", "decode_final", "draw", "render_png"]

DPI = 100
PLOT_WIDTH = 1400
PLOT_HEIGHT = 900
MAX_SAMPLE_LEGEND = 8
"""Up to this many samples the log-prob legend names each sample; beyond it, each prompt."""
MAX_PROMPT_LEGEND = 10
"""The most entries the per-prompt legend has: past it, the first prompts and "... N more prompts"
(a legend of 20 prompts covered the panel and its title)."""
MAX_COLUMNS = 8
"""Decoded samples shown (the panel says how many more there are)."""
MAX_FRAMES = 5
"""Frames shown per video sample (evenly spaced, first and last included)."""
MAX_VIDEO_ROWS = 4
"""Video samples shown, a row of frames each."""
_STOCHASTIC = "tab:red"


@dataclass
class Decoded:
    """uint8 images [B, H, W, 3] or frames [B, F, H, W, 3], or None with the reason why not."""

    pixels: np.ndarray[Any, Any] | None
    why_not: str = ""
    note: str = ""


def _prompts(rep: Report) -> list[str]:
    return [str(p) for p in (rep.rollout.get("request") or {}).get("prompts") or []]


def _prompt_of_sample(rep: Report, sample: int) -> int:
    per = rep.rollout.get("num_outputs_per_prompt") or (rep.rollout.get("request") or {}).get(
        "num_outputs_per_prompt") or 1
    return sample // int(per)  # prompt-major (contract: sample = prompt_index * n + k)


def decode_final(path: str | Path, rep: Report, *, model_dir: str | Path | None = None) -> Decoded:
    """Decode x_T of the trajectory file through the model's VAE, or say why not."""
    model_id = (rep.rollout.get("model") or {}).get("id")
    from sigmaflight.dataplane.client import Trajectory

    traj = Trajectory.from_file(path)
    if not traj.has_step(traj.num_steps):
        return Decoded(None, f"x_T (step {traj.num_steps}) was not streamed: add it to return.steps")
    from sigmaflight.pipeline.decode import decode_uint8
    from sigmaflight.pipeline.models import ModelRegistry

    registry = ModelRegistry()
    try:
        if model_dir is not None:
            if not Path(model_dir).is_dir():
                return Decoded(None, f"--model-dir {str(model_dir)!r} is not a directory")
            model = registry.register_local(str(model_id or "local"), str(model_dir))
        elif model_id in registry.ids():  # a fresh registry knows the built-ins only
            model = registry.get(str(model_id))
        else:
            return Decoded(None, f"model {model_id!r} is not available here: it is not a built-in; "
                           "pass --model-dir with the directory the server loaded")
    except Exception as exc:  # a broken model directory: draw the reason, the rest of the plot still helps
        return Decoded(None, f"could not load model {model_id!r}: {type(exc).__name__}: {exc}")
    request = rep.rollout.get("request") or {}
    height = request.get("height") or model.defaults.height
    width = request.get("width") or model.defaults.width
    try:
        pixels = decode_uint8(model, traj.latent(traj.num_steps), height=height, width=width)
    except ValueError as exc:
        return Decoded(None, str(exc))
    digest = (rep.rollout.get("model") or {}).get("digest")
    note = "" if digest in (None, model.digest) else " (weights differ from the rollout's; the VAE decodes all the same)"
    return Decoded(pixels, note=note)


def _schedule_panel(ax: Axes, rep: Report) -> None:
    ax.set_title("sigma schedule by absolute step index")
    ax.set_xlabel("absolute step index i")
    ax.set_ylabel("sigma_i")
    sig = [r["sigma"] for r in rep.schedule]
    if not sig:
        ax.text(0.5, 0.5, "no sigmas in the metadata", ha="center", va="center", transform=ax.transAxes)
        return
    steps = list(range(len(sig)))
    ax.plot(steps, sig, color="0.3", marker="o", markersize=4, label="sigma_i")
    sde = [r["i"] for r in rep.schedule if r["sde"]]
    if sde:
        ax.plot(sde, [sig[i] for i in sde], linestyle="none", marker="o", markersize=8, color=_STOCHASTIC,
                label="stochastic transition i -> i+1")
    streamed = [r["i"] for r in rep.schedule if r["streamed"]]
    if streamed:
        ax.plot(streamed, [sig[i] for i in streamed], linestyle="none", marker="s", markersize=11,
                markerfacecolor="none", color="tab:blue", label="latent x_i streamed")
    _integer_ticks(ax, steps)
    ax.set_ylim(bottom=min(0.0, min(sig)) - 0.03, top=max(sig) + 0.05)
    ax.grid(True, alpha=0.3)
    ax.legend(loc="upper right", fontsize=8)


def _log_prob_panel(ax: Axes, rep: Report) -> None:
    ax.set_title("log_prob per transition")
    ax.set_xlabel("transition i (x_i -> x_i+1)")
    ax.set_ylabel("log_prob")
    m = rep.log_prob_matrix
    samples = sorted({s for per in m.values() for s in per})
    if not samples:
        ax.text(0.5, 0.5, "no log-probs in this trajectory\n(deterministic sampler or return.log_probs=false)",
                ha="center", va="center", transform=ax.transAxes)
        return
    prompts = _prompts(rep)
    by_prompt = len(samples) > MAX_SAMPLE_LEGEND
    colours = [f"C{k % 10}" for k in range(max(len(samples), len(prompts), 1))]
    labelled: set[int] = set()
    for sample in samples:
        xs = [step for step in sorted(m) if sample in m[step] and math.isfinite(m[step][sample])]
        ys = [m[step][sample] for step in xs]
        p = _prompt_of_sample(rep, sample)
        text = prompts[p] if p < len(prompts) else f"prompt {p}"
        if by_prompt:
            named = len(prompts) <= MAX_PROMPT_LEGEND or p < MAX_PROMPT_LEGEND - 1
            colour = colours[p % len(colours)]
            label = None if p in labelled or not named else f"prompt {p}: {_short(text, 28)}"
            labelled.add(p)
        else:
            colour, label = colours[sample], f"sample {sample} ({_short(text, 20)})"
        ax.plot(xs, ys, color=colour, marker="o", markersize=4, linewidth=1.2, label=label)
    if by_prompt and len(prompts) > MAX_PROMPT_LEGEND:
        ax.plot([], [], color="none", label=f"... {len(prompts) - MAX_PROMPT_LEGEND + 1} more prompts")
    _integer_ticks(ax, sorted(m))
    ax.grid(True, alpha=0.3)
    ax.legend(loc="best", fontsize=8, title="per prompt" if by_prompt else "per sample", title_fontsize=8)


def _integer_ticks(ax: Axes, steps: list[int]) -> None:
    """Every step index as a tick up to 16 of them; beyond, about 12 integer ticks."""
    if len(steps) <= 16:
        ax.set_xticks(steps)
    else:
        ax.xaxis.set_major_locator(MaxNLocator(nbins=12, integer=True))


def _label(text: str, width: int = 22, lines: int = 3) -> str:
    wrapped = textwrap.wrap(text, width)
    if len(wrapped) > lines:
        wrapped = [*wrapped[: lines - 1], _short(wrapped[lines - 1] + " " + wrapped[lines], width)]
    return "\n".join(wrapped)


def _short(text: str, n: int) -> str:
    return text if len(text) <= n else text[: n - 1] + "\u2026"


def _image_panel(fig: Figure, spec: Any, rep: Report, decoded: Decoded) -> None:
    title = "final latents x_T decoded by the model's own VAE" + decoded.note
    if decoded.pixels is None:
        ax = fig.add_subplot(spec)
        ax.set_axis_off()
        ax.set_title(title)
        ax.text(0.5, 0.5, "no images: " + "\n".join(textwrap.wrap(decoded.why_not, 110)), ha="center",
                va="center", fontsize=11, transform=ax.transAxes,
                bbox={"boxstyle": "round", "facecolor": "0.95", "edgecolor": "0.6"})
        return
    pixels = decoded.pixels
    n = int(pixels.shape[0])
    prompts = _prompts(rep)
    if pixels.ndim == 5:  # video [B, F, H, W, 3]: a row of frames per sample
        shown = min(n, MAX_VIDEO_ROWS)
        f = int(pixels.shape[1])
        frames = sorted({round(k * (f - 1) / (MAX_FRAMES - 1)) for k in range(MAX_FRAMES)}) if f > 1 else [0]
        title += f": video, {f} frames a sample, frames {', '.join(map(str, frames))} shown"
        grid = spec.subgridspec(shown, len(frames), hspace=0.55, wspace=0.04)
        cells = [[(grid[row, k], pixels[row, frame], f"frame {frame}") for k, frame in enumerate(frames)]
                 for row in range(shown)]
    else:  # images [B, H, W, 3]: one column per sample
        shown = min(n, MAX_COLUMNS)
        grid = spec.subgridspec(1, shown, wspace=0.08)
        cells = [[(grid[0, col], pixels[col], "")] for col in range(shown)]
    if n > shown:
        title += f" (first {shown} of {n} samples)"
    fig.text(0.5, spec.get_position(fig).y1 + (0.035 if pixels.ndim == 5 else 0.01), title, ha="center", va="bottom", fontsize=12)
    for sample, row_cells in enumerate(cells):
        axes = []
        for cell, image, frame_label in row_cells:
            ax = fig.add_subplot(cell)
            ax.imshow(image, interpolation="nearest")
            ax.set_xticks([])
            ax.set_yticks([])
            if frame_label and sample == 0:
                ax.set_title(frame_label, fontsize=8)
            axes.append(ax)
        p = _prompt_of_sample(rep, sample)
        text = f"#{sample}: {prompts[p] if p < len(prompts) else f'prompt {p}'}"
        if len(axes) > 1:  # a video row: the label under its middle frame
            axes[len(axes) // 2].set_xlabel(_short(text, 60), fontsize=9)
        else:
            axes[0].set_xlabel(_label(text), fontsize=9)


def draw(rep: Report, decoded: Decoded) -> Figure:
    """The figure (no pyplot, no display): schedule and log-prob panels above, decoded images below."""
    fig = Figure(figsize=(PLOT_WIDTH / DPI, PLOT_HEIGHT / DPI), dpi=DPI)
    model = (rep.rollout.get("model") or {}).get("id")
    fig.suptitle(f"rollout {rep.rollout.get('id')}  \u00b7  model {model}  \u00b7  "
                 f"{rep.rollout.get('num_samples')} samples  \u00b7  sampler "
                 f"{(rep.rollout.get('sampler') or {}).get('type')}", fontsize=13)
    outer = fig.add_gridspec(2, 1, height_ratios=[1.0, 1.0], hspace=0.38, left=0.06, right=0.98, top=0.91,
                             bottom=0.08)
    top = outer[0].subgridspec(1, 2, wspace=0.18)
    _schedule_panel(fig.add_subplot(top[0, 0]), rep)
    _log_prob_panel(fig.add_subplot(top[0, 1]), rep)
    _image_panel(fig, outer[1], rep, decoded)
    return fig


def render_png(path: str | Path, rep: Report, out: str | Path, *, decode: bool = True,
               model_dir: str | Path | None = None) -> tuple[int, int]:
    """Write the PNG; returns its (width, height), always (PLOT_WIDTH, PLOT_HEIGHT)."""
    decoded = decode_final(path, rep, model_dir=model_dir) if decode else Decoded(
        None, "decoding switched off (--no-decode)")
    fig = draw(rep, decoded)
    fig.savefig(out, format="png", dpi=DPI)
    w, h = fig.canvas.get_width_height()
    return int(w), int(h)
