"""`plot-metrics FILE... [--output_dir DIR]`: loss, throughput and load-balance PNGs.

Each FILE is a metrics.jsonl written by `train` (or a run directory holding
one); every run is one line on each chart, labelled by its run directory name
(or `--labels`). Writes loss.png, throughput.png and, when any run has MoE
layers, load_balance.png; when any run has multi-token prediction, mtp_loss.png
(one line per run and depth). A run with evaluations gets its eval loss on the loss
chart too, beside its training loss: same colour, dashed, a point per evaluation.
MoE runs also get plots_moe's charts: expert_load_<run>.png (a layer x expert heat
map over steps), load_balance_per_layer.png, routing_bias.png and, with a
capacity_factor, dropped_tokens.png.
"""

from __future__ import annotations

import argparse
import os
import sys

from trainer.io import plots_moe
from trainer.io.metrics import METRICS_FILE, read

# Drawn on the same chart as a key, per run: the eval curve beside the training loss.
COMPANIONS = {"learning/loss": ("eval_loss", "eval")}
# chart file -> (title, y label, record key)
CHARTS = {
    "loss.png": ("Training and eval loss", "loss", "learning/loss"),
    "throughput.png": ("Throughput", "tokens / s", "perf/tokens_per_s"),
    "load_balance.png": (
        "MoE load imbalance (max / mean expert load, worst layer)",
        "max / mean",
        "moe/load_imbalance",
    ),
    # A key ending in '*': one line per matching key (here, per MTP depth).
    "mtp_loss.png": ("Multi-token prediction loss per depth", "loss", "learning/mtp_loss_*"),
}


def _series(records: list[dict], key: str, label: str) -> list[tuple[str, str]]:
    """(record key, legend label) of the lines a chart key draws for one run."""
    if not key.endswith("*"):
        return [(key, label)]
    found = sorted({k for r in records for k in r if k.startswith(key[:-1])})
    return [(k, f"{label} depth {k[len(key) - 1 :]}") for k in found]


def _label(path: str, taken: set[str]) -> str:
    parent = os.path.basename(os.path.dirname(os.path.abspath(path)))
    stem = os.path.splitext(os.path.basename(path))[0]
    label = parent if stem == "metrics" and parent else stem
    while label in taken:
        label += "'"
    taken.add(label)
    return label


def load_runs(paths: list[str], labels: list[str] | None = None) -> list[tuple[str, list[dict]]]:
    """(label, records) per input; a directory stands for its metrics.jsonl."""
    if labels and len(labels) != len(paths):
        raise ValueError(f"--labels has {len(labels)} names for {len(paths)} files")
    runs, taken = [], set()
    for i, path in enumerate(paths):
        if os.path.isdir(path):
            path = os.path.join(path, METRICS_FILE)
        records = read(path)
        if not records:
            raise ValueError(f"{path}: no metrics records")
        runs.append((labels[i] if labels else _label(path, taken), records))
    return runs


def _points(records: list[dict], key: str) -> list[tuple[int, float]]:
    return [(r["step"], r[key]) for r in records if r.get(key) is not None]


def _draw_companion(ax, records: list[dict], key: str, suffix: str, label: str, color) -> None:
    points = _points(records, key)
    if points:
        steps, values = zip(*points, strict=True)
        ax.plot(steps, values, linestyle="--", marker="o", color=color, label=f"{label} {suffix}")


def plot(runs: list[tuple[str, list[dict]]], output_dir: str) -> list[str]:
    """Draw every chart some run has data for; returns the PNG paths written."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    os.makedirs(output_dir, exist_ok=True)
    written = []
    for filename, (title, ylabel, key) in CHARTS.items():
        fig, ax = plt.subplots(figsize=(7, 4), dpi=100)
        drawn = 0
        for run_label, records in runs:
            for series, label in _series(records, key, run_label):
                points = _points(records, series)
                if not points:
                    continue
                steps, values = zip(*points, strict=True)
                line = ax.plot(
                    steps, values, marker="." if len(points) < 50 else None, label=label
                )[0]
                drawn += 1
                if key in COMPANIONS:
                    _draw_companion(ax, records, *COMPANIONS[key], label, line.get_color())
        if drawn:
            ax.set_title(title)
            ax.set_xlabel("step")
            ax.xaxis.set_major_locator(MaxNLocator(integer=True))
            ax.set_ylabel(ylabel)
            ax.grid(alpha=0.3)
            ax.legend()
            fig.tight_layout()
            path = os.path.join(output_dir, filename)
            fig.savefig(path)
            written.append(path)
        plt.close(fig)
    return written + plots_moe.plot(runs, output_dir)


def build_parser() -> argparse.ArgumentParser:
    """plot-metrics' command line (tests/test_doc_commands.py checks the docs' against it)."""
    parser = argparse.ArgumentParser(prog="plot-metrics", description=__doc__.splitlines()[0])
    parser.add_argument("files", nargs="+", help="metrics.jsonl files or run directories")
    parser.add_argument("--output_dir", default="plots", help="where the PNGs go (default plots)")
    parser.add_argument("--labels", nargs="+", help="one legend name per file")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        runs = load_runs(args.files, args.labels)
    except (OSError, ValueError) as error:
        print(f"plot-metrics: {error}", file=sys.stderr)
        return 2
    for path in plot(runs, args.output_dir):
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
