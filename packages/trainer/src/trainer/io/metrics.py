"""Per-step metrics: one JSONL record per step and TensorBoard event files, under run_dir.

Record keys (`record(step_metrics)`):

    step
    learning/loss, learning/ce_loss, learning/balance_loss, learning/grad_norm, learning/lr
    learning/mtp_loss_K              (MTP on) depth K's cross-entropy, K = 1..mtp_num_layers
    perf/step_time_s, perf/tokens_per_s, perf/tokens, perf/mfu (null when the peak is unknown)
    moe/tokens_per_expert            [MoE layer][expert] tokens routed this step
    moe/load_imbalance_per_layer     [MoE layer] max / mean expert load
    moe/load_imbalance               the worst layer's max / mean (1.0 = perfectly balanced)
    moe/dropped_share_per_layer      (capacity_factor > 0) [MoE layer] share of the step's
                                     assignments (tokens x experts per token) dropped
    moe/dropped_share                (capacity_factor > 0) the layers' mean share dropped
    moe/routing_bias                 {min, max, mean, std: [MoE layer]} of the routing bias
                                     after the step's update (read on the host)
    learning/router_z_loss           (moe_z_loss_coeff > 0) mean over MoE layers of the
                                     router z (logsumexp(logits)^2), unscaled

and after each evaluation (`write_eval`) a record of its own for the same step:

    step, eval_loss, eval_perplexity, eval_tokens, eval_time_s
    (+ eval_mtp_acceptance_K with mtp_eval_target_module=K: depth K's top-1 acceptance)

Only process 0 writes. A run that starts at step N (a resumed run) keeps the
records of steps 1..N already in the file and drops later ones, so a restart
after a crash does not leave duplicate steps; a fresh run (N = 0) starts the
file over. An eval record of step N is dropped too: a run resumed at an eval
step evaluates again (run.train). TensorBoard gets `purge_step=N + 1` for the
same reason. `read` merges the records of one step into one.
"""

from __future__ import annotations

import json
import os
from typing import Any

import numpy as np

METRICS_FILE = "metrics.jsonl"
TENSORBOARD_DIR = "tensorboard"

# run.train's host metric name -> record key.
RENAMES = {
    "loss": "learning/loss",
    "ce_loss": "learning/ce_loss",
    "balance_loss": "learning/balance_loss",
    "router_z_loss": "learning/router_z_loss",
    "grad_norm": "learning/grad_norm",
    "learning_rate": "learning/lr",
    "step_time_s": "perf/step_time_s",
    "tokens_per_s": "perf/tokens_per_s",
    "tokens": "perf/tokens",
    "mfu": "perf/mfu",
}


# run.train's per-depth MTP metric names start with this; records get learning/ in front.
MTP_LOSS = "mtp_loss_"
EVAL_MTP_ACCEPTANCE = "eval_mtp_acceptance_"


def mtp_losses(metrics: dict) -> list[tuple[int, float]]:
    """(depth, loss) of the MTP metrics in `metrics` (run.train's), by depth."""
    found = [(int(k[len(MTP_LOSS) :]), v) for k, v in metrics.items() if k.startswith(MTP_LOSS)]
    return sorted(found)


def load_imbalance(tokens_per_expert_LxE: Any) -> list[float]:
    """max / mean expert load per MoE layer (1.0 when every expert gets the same)."""
    loads = np.asarray(tokens_per_expert_LxE, dtype=np.float64)
    if loads.ndim == 1:
        loads = loads[None]
    mean = loads.mean(axis=-1)
    return [float(m / a) if a > 0 else 1.0 for m, a in zip(loads.max(axis=-1), mean, strict=True)]


def record(metrics: dict) -> dict:
    """The JSONL record for one step of `run.train`'s host metrics."""
    out: dict[str, Any] = {"step": int(metrics["step"]), "perf/mfu": None}
    for key, value in metrics.items():
        if key in RENAMES:
            out[RENAMES[key]] = value
        elif key.startswith(MTP_LOSS):
            out[f"learning/{key}"] = value
        elif key == "tokens_per_expert":
            per_layer = load_imbalance(value)
            out["moe/tokens_per_expert"] = np.asarray(value).tolist()
            out["moe/load_imbalance_per_layer"] = per_layer
            out["moe/load_imbalance"] = max(per_layer)
        elif key == "dropped_share":
            shares = np.atleast_1d(np.asarray(value, dtype=np.float64))
            out["moe/dropped_share_per_layer"] = shares.tolist()
            out["moe/dropped_share"] = float(shares.mean())
        elif key == "routing_bias":
            out["moe/routing_bias"] = value
        elif key != "step":
            out[key] = value
    return out


# Per-layer record lists -> the TensorBoard tag each layer's scalar goes under.
PER_LAYER = {
    "moe/load_imbalance_per_layer": "moe/load_imbalance",
    "moe/dropped_share_per_layer": "moe/dropped_share",
}


def bias_stats(bias_LxE: Any) -> dict[str, list[float]]:
    """min, max, mean and std per MoE layer of the routing bias (L, E)."""
    bias = np.atleast_2d(np.asarray(bias_LxE, dtype=np.float64))
    return {
        "min": bias.min(-1).tolist(),
        "max": bias.max(-1).tolist(),
        "mean": bias.mean(-1).tolist(),
        "std": bias.std(-1).tolist(),
    }


def scalars(rec: dict) -> dict[str, float]:
    """The TensorBoard scalars of a record: every number, per-layer imbalance split out."""
    out = {}
    for key, value in rec.items():
        if key == "step" or value is None:
            continue
        if isinstance(value, int | float):
            out[key] = float(value)
        elif key in PER_LAYER:
            for layer, v in enumerate(value):
                out[f"{PER_LAYER[key]}/layer_{layer}"] = float(v)
        elif key == "moe/routing_bias":
            for stat, per_layer in value.items():
                for layer, v in enumerate(per_layer):
                    out[f"moe/routing_bias/layer_{layer}/{stat}"] = float(v)
    return out


EVAL_KEYS = ("eval_loss", "eval_perplexity", "eval_tokens", "eval_time_s")


def _keep(rec: dict, last_step: int) -> bool:
    """Records a run resumed at `last_step` keeps: earlier steps, and step
    `last_step`'s training record (its evaluation, if any, is redone)."""
    if "eval_loss" in rec:
        return rec["step"] < last_step
    return rec["step"] <= last_step


def _keep_until(path: str, last_step: int) -> None:
    """Rewrite `path` keeping only records with step <= last_step (none when 0),
    less an eval record of step last_step."""
    if not os.path.exists(path):
        return
    kept = []
    with open(path) as f:
        for line in f:
            try:
                if _keep(json.loads(line), last_step):
                    kept.append(line)
            except (ValueError, KeyError, TypeError):
                continue  # a line cut short by a killed process
    with open(path, "w") as f:
        f.writelines(kept)


class MetricsWriter:
    """JSONL (+ TensorBoard) writer; a no-op on processes other than 0.

    `jsonl_path` defaults to run_dir/metrics.jsonl; TensorBoard files go to
    run_dir/tensorboard (where profiling.py also puts traces).
    """

    def __init__(
        self,
        run_dir: str,
        *,
        start_step: int = 0,
        jsonl_path: str | None = None,
        tensorboard: bool = True,
        process_index: int = 0,
    ):
        self.active = process_index == 0
        self.jsonl_path = jsonl_path or os.path.join(run_dir, METRICS_FILE)
        self.tensorboard_dir = os.path.join(run_dir, TENSORBOARD_DIR)
        self._jsonl = None
        self._tb = None
        if not self.active:
            return
        os.makedirs(os.path.dirname(os.path.abspath(self.jsonl_path)), exist_ok=True)
        _keep_until(self.jsonl_path, start_step)
        self._jsonl = open(self.jsonl_path, "a")  # noqa: SIM115 -- closed by close()
        if tensorboard:
            from tensorboardX import SummaryWriter

            self._tb = SummaryWriter(self.tensorboard_dir, purge_step=start_step + 1)

    def write(self, metrics: dict) -> dict:
        """Write one step (run.train's host metrics); returns the record."""
        return self._emit(record(metrics))

    def write_eval(self, step: int, result: dict) -> dict:
        """Write one complete evaluation (`Evaluator.evaluate`'s result) at `step`."""
        keys = [*EVAL_KEYS, *(k for k in result if k.startswith(EVAL_MTP_ACCEPTANCE))]
        return self._emit({"step": int(step), **{k: result[k] for k in keys}})

    def _emit(self, rec: dict) -> dict:
        if self._jsonl:
            self._jsonl.write(json.dumps(rec, sort_keys=True) + "\n")
            self._jsonl.flush()
        if self._tb:
            for key, value in scalars(rec).items():
                self._tb.add_scalar(key, value, rec["step"])
            self._tb.flush()
        return rec

    def close(self) -> None:
        if self._jsonl:
            self._jsonl.close()
            self._jsonl = None
        if self._tb:
            self._tb.close()
            self._tb = None

    def __enter__(self) -> MetricsWriter:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def read(path: str) -> list[dict]:
    """Records of a metrics file, one per step: a step's training and eval records
    merged (for a key written twice, the later record wins)."""
    by_step: dict[int, dict] = {}
    with open(path) as f:
        for line in f:
            line = line.strip()
            if not line:
                continue
            try:
                rec = json.loads(line)
                step = int(rec["step"])
                by_step[step] = {**by_step.get(step, {}), **rec}
            except (ValueError, KeyError, TypeError):
                continue  # a line cut short by a killed process
    return [by_step[s] for s in sorted(by_step)]


def output_lines(writer: MetricsWriter, profiler: Any = None) -> list[str]:
    """Where this run's metrics (and trace) go, for the startup printout."""
    if not writer.active:
        return []
    tb = f", tensorboard: {writer.tensorboard_dir}" if writer._tb else ""
    lines = [f"metrics: {writer.jsonl_path}{tb}"]
    if profiler is not None and profiler.enabled:
        lines.append(
            f"profiler: xplane trace of steps {profiler.first}-{profiler.last} "
            f"-> {profiler.log_dir}/plugins/profile"
        )
    return lines
