"""plot-metrics' MoE charts: what a router does, layer by layer and expert by expert.

- `expert_load_<run>.png`: per run, one heat map per MoE layer, expert x step, each
  cell the expert's tokens over the layer's mean load that step (1 = fair share);
  the view people read routing collapse from.
- `load_balance_per_layer.png`: max / mean expert load per layer over steps.
- `dropped_tokens.png` (runs with a capacity_factor): share of each layer's
  assignments dropped over steps.
- `routing_bias.png`: the aux-loss-free routing bias per layer over steps, its
  mean as a line and its min..max as a band.

Each reads the record keys metrics.py writes; a chart no run has data for is skipped.
"""

from __future__ import annotations

import os
import re

import numpy as np

# chart file -> (title, y label, per-layer record key)
PER_LAYER_CHARTS = {
    "load_balance_per_layer.png": (
        "MoE load imbalance per layer (max / mean expert load)",
        "max / mean",
        "moe/load_imbalance_per_layer",
    ),
    "dropped_tokens.png": (
        "Assignments dropped by capacity_factor, per layer",
        "share dropped",
        "moe/dropped_share_per_layer",
    ),
}


def _layer_series(records: list[dict], key: str) -> tuple[list[int], np.ndarray] | None:
    """(steps, values (steps, layers)) of a per-layer list key, or None if absent."""
    rows = [(r["step"], r[key]) for r in records if r.get(key) is not None]
    if not rows:
        return None
    steps, values = zip(*rows, strict=True)
    return list(steps), np.asarray(values, dtype=np.float64)


def _finish(fig, ax, title: str, ylabel: str, path: str, legend: bool = True) -> str:
    from matplotlib.ticker import MaxNLocator

    ax.set_title(title)
    ax.set_xlabel("step")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    if legend:
        ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path)
    return path


def _per_layer_charts(plt, runs, output_dir: str) -> list[str]:
    written = []
    for filename, (title, ylabel, key) in PER_LAYER_CHARTS.items():
        found = [(label, _layer_series(records, key)) for label, records in runs]
        found = [(label, s) for label, s in found if s is not None]
        if not found:
            continue
        fig, ax = plt.subplots(figsize=(7, 4), dpi=100)
        for label, (steps, values) in found:
            for layer in range(values.shape[1]):
                ax.plot(steps, values[:, layer], label=f"{label} layer {layer}")
        written.append(_finish(fig, ax, title, ylabel, os.path.join(output_dir, filename)))
        plt.close(fig)
    return written


def _bias_chart(plt, runs, output_dir: str) -> list[str]:
    fig, ax = plt.subplots(figsize=(7, 4), dpi=100)
    drawn = 0
    for label, records in runs:
        rows = [(r["step"], r["moe/routing_bias"]) for r in records if r.get("moe/routing_bias")]
        if not rows:
            continue
        steps = [s for s, _ in rows]
        stat = {k: np.asarray([b[k] for _, b in rows], np.float64) for k in ("min", "max", "mean")}
        for layer in range(stat["mean"].shape[1]):
            line = ax.plot(steps, stat["mean"][:, layer], label=f"{label} layer {layer} mean")[0]
            ax.fill_between(
                steps, stat["min"][:, layer], stat["max"][:, layer],
                color=line.get_color(), alpha=0.15,
            )  # fmt: skip
            drawn += 1
    path = os.path.join(output_dir, "routing_bias.png")
    written = [_finish(fig, ax, "Routing bias per layer (mean; band: min..max)", "bias", path)]
    plt.close(fig)
    return written if drawn else []


def _safe(label: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", label) or "run"


def _heat_maps(plt, runs, output_dir: str) -> list[str]:
    written = []
    for label, records in runs:
        key = "moe/tokens_per_expert"
        rows = [(r["step"], r[key]) for r in records if r.get(key)]
        if not rows:
            continue
        steps = [s for s, _ in rows]
        loads = np.asarray([np.atleast_2d(v) for _, v in rows], np.float64)  # (steps, L, E)
        mean = loads.mean(axis=-1, keepdims=True)
        relative = np.divide(loads, mean, out=np.ones_like(loads), where=mean > 0)
        layers, experts = relative.shape[1], relative.shape[2]
        fig, axes = plt.subplots(
            layers, 1, figsize=(8, 1.2 + 1.6 * layers), dpi=100, squeeze=False, sharex=True
        )
        top = max(2.0, float(relative.max()))
        for layer in range(layers):
            ax = axes[layer, 0]
            image = ax.imshow(
                relative[:, layer, :].T, aspect="auto", origin="lower", cmap="viridis",
                vmin=0.0, vmax=top, interpolation="nearest",
                extent=(steps[0] - 0.5, steps[-1] + 0.5, -0.5, experts - 0.5),
            )  # fmt: skip
            ax.set_ylabel(f"layer {layer}\nexpert")
        axes[-1, 0].set_xlabel("step")
        fig.colorbar(image, ax=axes[:, 0].tolist(), label="load / mean load")
        fig.suptitle(f"{label}: tokens per expert over the layer's mean, per step")
        path = os.path.join(output_dir, f"expert_load_{_safe(label)}.png")
        fig.savefig(path)
        plt.close(fig)
        written.append(path)
    return written


def plot(runs: list[tuple[str, list[dict]]], output_dir: str) -> list[str]:
    """Draw every MoE chart some run has data for; returns the PNG paths written."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    os.makedirs(output_dir, exist_ok=True)
    return [
        *_per_layer_charts(plt, runs, output_dir),
        *_bias_chart(plt, runs, output_dir),
        *_heat_maps(plt, runs, output_dir),
    ]
