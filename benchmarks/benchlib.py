"""Shared pieces of the bench_*.py scripts: environment header, tables, files, timing, fit.

Not a benchmark itself (`nox -s bench` runs only bench_*.py). Import after the
script has set `jax_num_cpu_devices`.
"""

from __future__ import annotations

import contextlib
import csv
import importlib.metadata
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable, Sequence

import numpy as np

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


def trainer_test_module(name: str):
    """packages/trainer/tests/<name>.py (test data shared with the benchmarks, kept out
    of the trainer wheel), loaded by path."""
    import importlib.util

    here = os.path.dirname(os.path.abspath(__file__))
    path = os.path.join(here, "..", "packages", "trainer", "tests", f"{name}.py")
    spec = importlib.util.spec_from_file_location(f"trainer_tests_{name}", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


MIB = 1 << 20
GIB = 1 << 30


def versions() -> str:
    names = ("jax", "jaxlib", "flax", "optax", "libtpu")
    found = []
    for name in names:
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            found.append(f"{name} {importlib.metadata.version(name)}")
    return ", ".join(found) + f", Python {sys.version.split()[0]}"


def machine() -> str:
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    return f"{platform.platform()}, {os.cpu_count()} CPU cores, load average {load}"


def revision() -> str:
    """The checkout's short commit, with "-dirty" where a file outside
    benchmarks/results differs from it (a page another benchmark just rewrote does
    not change what this one measures)."""
    import subprocess

    def git(*args: str) -> str:
        out = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, check=True)
        return out.stdout.strip()

    try:
        commit = git("describe", "--always")
        changed = git(
            "status", "--porcelain", "--untracked-files=no", "--", ".", ":!benchmarks/results"
        )
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return commit + ("-dirty" if changed else "")


def header(title: str, command: str, notes: Sequence[str] = ()) -> list[str]:
    lines = [f"# {title}", "", f"Command: `{command}`", "", f"- versions: {versions()}"]
    lines.append(f"- tree: {revision()}")
    lines.append(f"- machine: {machine()} (at the end of the run)")
    lines += [f"- {n}" for n in notes]
    return lines + [""]


def accumulation_note() -> str:
    """The trainer's default gradient-accumulation schedule, for a page whose steps use it."""
    from trainer.config import Config

    return (
        "gradient accumulation: the trainer's default, "
        f"gradient_accumulation_schedule={Config.gradient_accumulation_schedule}"
    )


def compiles_note(rows: Sequence[dict], wall: float, reuse: bool) -> str:
    """The header note of a page of cached AOT compiles (rows with compile_s and tree):
    how many, their compile time, the trees they were compiled at, and with `reuse`
    this analysis pass's time."""
    trees = ", ".join(dict.fromkeys(r["tree"] for r in rows if "tree" in r))
    return (
        f"run: {len(rows)} compiles, "
        f"{sum(r.get('compile_s', 0) for r in rows) / 60:.1f} min of compile time; "
        f"compiled at {trees}"
        + (f"; this analysis pass {wall / 60:.1f} min, reading cached HLO" if reuse else "")
    )


def table(columns: Sequence[str], rows: Sequence[Sequence[str]], align: str = "") -> list[str]:
    align = align or "l" + "r" * (len(columns) - 1)
    marks = ["---:" if a == "r" else "---" for a in align]
    out = ["| " + " | ".join(columns) + " |", "|" + "|".join(marks) + "|"]
    out += ["| " + " | ".join(str(x) for x in row) + " |" for row in rows]
    return out


def write(name: str, lines: Sequence[str], rows: Sequence[dict] = (), directory: str = "") -> None:
    """<directory>/<name>.md (and .csv from `rows`); echoes the page.

    `directory` defaults to benchmarks/results."""
    directory = directory or RESULTS
    os.makedirs(directory, exist_ok=True)
    if rows:
        fields = list(dict.fromkeys(k for r in rows for k in r))
        with open(os.path.join(directory, f"{name}.csv"), "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=fields)
            writer.writeheader()
            writer.writerows(rows)
    text = "\n".join(lines) + "\n"
    with open(os.path.join(directory, f"{name}.md"), "w") as f:
        f.write(text)
    print(text, flush=True)


def mib(x: float) -> str:
    return f"{x / MIB:,.2f}"


def interleaved(
    fns: dict, warmup: int, rounds: int, sync: Callable | None = None
) -> dict[str, list[float]]:
    """Time each callable once per round, in turn (so drift in machine load hits all
    alike), every other round in reverse order (so neither of two neighbours always
    runs first); returns the post-warm-up samples per key. Each callable runs one
    step and returns something to block on."""
    import jax

    samples = {key: [] for key in fns}
    order = list(fns.items())
    for round_ in range(warmup + rounds):
        for key, fn in order if round_ % 2 == 0 else reversed(order):
            start = time.perf_counter()
            jax.block_until_ready(fn())
            seconds = time.perf_counter() - start
            if round_ >= warmup:
                samples[key].append(seconds)
    return samples


def median(xs: Sequence[float]) -> float:
    return statistics.median(xs)


def fit_deferral(points: dict[tuple[int, bool], float]) -> tuple[float, float, float]:
    """Least squares T = o + N*c + {N*a per microbatch | a deferred} over (N, deferred)."""
    rows, ys = [], []
    for (n, deferred), t in points.items():
        rows.append([1.0, n, 1.0 if deferred else n])
        ys.append(t)
    solution, *_ = np.linalg.lstsq(np.array(rows), np.array(ys), rcond=None)
    return tuple(float(x) for x in solution)


def ceiling(c: float, a: float, n: int) -> float:
    """(c+a)/(c+a/N): the speedup deferral can give at N microbatches, overhead aside."""
    return (c + a) / (c + a / n)


def fitted_speedup(o: float, c: float, a: float, n: int) -> float:
    return (o + n * (c + a)) / (o + n * c + a)


def plot_bars(path: str, title: str, labels, series: dict[str, Sequence[float]], ylabel: str):
    """Grouped bar chart (matplotlib Agg) to `path`."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    x = np.arange(len(labels))
    width = 0.8 / max(1, len(series))
    fig, ax = plt.subplots(figsize=(max(6, 0.7 * len(labels) + 2), 4))
    for i, (name, values) in enumerate(series.items()):
        ax.bar(x + (i - (len(series) - 1) / 2) * width, values, width, label=name)
    ax.set_xticks(x, labels, rotation=30, ha="right")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


class TrainerStep:
    """One trainer configuration on this host's devices: compiled once, stepped on demand.

    `step()` runs one optimizer step on a fixed batch (the state is donated and
    replaced, as in `run.train`); `memory` is the compiled memory analysis per
    device; `traffic` the hlo_tools byte accounting of the compiled step.
    `floor=True` runs trainer.run.floor's hand-written shard_map step instead.
    """

    def __init__(self, overrides: dict[str, str], devices=None, floor: bool = False):
        import jax

        import hlo_tools
        from trainer.config import make_config
        from trainer.run import aot
        from trainer.run import floor as floor_lib
        from trainer.run import run as run_lib

        self.overrides = dict(overrides)
        self.config = make_config({"enable_tensorboard": "false", **overrides})
        # floor: the same run with trainer.run.floor's hand-written shard_map step.
        setup = floor_lib.setup_floor if floor else run_lib.setup
        self.run = setup(self.config, devices if devices is not None else jax.devices())
        self.batch = run_lib.batch_for(self.run, 0)
        start = time.perf_counter()
        self.compiled = run_lib.compile_step(self.run)
        self.compile_s = time.perf_counter() - start
        self.text = self.compiled.as_text()
        self.module = hlo_tools.parse(self.text)
        self.traffic = hlo_tools.traffic(self.module)
        self.memory = aot.memory_of(self.compiled)
        self._mesh = self.run.ctx.mesh

    def step(self):
        import jax

        with jax.set_mesh(self._mesh):
            self.run.state, metrics = self.compiled(self.run.state, self.batch)
        return self.run.state, metrics

    def bytes(self, where: str, kinds=None) -> int:
        """Collective bytes per step `in_loop` or `outside`, of `kinds` (default all)."""
        rows = self.traffic[where]
        return sum(r["bytes_per_step"] for k, r in rows.items() if kinds is None or k in kinds)

    def reduction_bytes(self, where: str) -> int:
        import hlo_tools

        return self.bytes(where, hlo_tools.REDUCTION_KINDS)

    def release(self) -> None:
        self.run.state = None
        self.compiled = None


def compile_steps(configs: dict) -> tuple[dict, dict]:
    """({key: TrainerStep}, {key: error line}) for `configs` ({key: overrides}): a
    configuration the trainer cannot build is recorded and reported, not fatal."""
    steps, failed = {}, {}
    for key, overrides in configs.items():
        label = " ".join(map(str, key)) if isinstance(key, tuple) else str(key)
        try:
            steps[key] = TrainerStep(overrides)
        except Exception as error:  # a configuration the trainer cannot build: say so
            failed[key] = f"{type(error).__name__}: {str(error).splitlines()[0]}"
            print(f"{label}: FAILED {failed[key][:300]}", flush=True)
            continue
        print(f"compiled {label}: {steps[key].compile_s:.1f} s", flush=True)
    return steps, failed


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def load_test_module(name: str):
    """A module of packages/trainer/tests by file name (its layouts are the source of truth)."""
    import importlib.util

    path = os.path.join(ROOT, "packages", "trainer", "tests", f"{name}.py")
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module
