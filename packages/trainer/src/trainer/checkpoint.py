"""Checkpoints with orbax: periodic async saves, keep the newest N, resume from the newest complete.

A checkpoint is step `N` under `run_dir/checkpoints/N` with two items: `state`
(params, optimizer state, router biases, step: every array of the run's state)
and `meta` (JSON: step, rows of data consumed, the config). The data position
and every random stream follow from (seed, step), so restoring the state
restores the run exactly.

Orbax writes each save to a temporary directory and renames it only once
complete, and deletes old checkpoints only after a newer one is complete, so a
save killed midway never damages the previous checkpoint. At startup, a
leftover temporary directory (deleted), or a step directory without orbax's
completion metadata (moved aside to `N.incomplete`, so it cannot shadow the
complete ones), is skipped with a warning naming it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import signal
import sys
import threading
import uuid
from collections.abc import Iterator
from typing import Any

import jax

from trainer.config import Config, ConfigError

SUBDIR = "checkpoints"
TMP_MARK = ".orbax-checkpoint-tmp"
INCOMPLETE = ".incomplete"
# A checkpoint written with any other value of these cannot be restored into this run.
MODEL_KEYS = (
    "vocab_size",
    "base_emb_dim",
    "base_num_decoder_layers",
    "first_num_dense_layers",
    "base_mlp_dim",
    "base_moe_mlp_dim",
    "num_experts",
    "shared_experts",
    "base_num_query_heads",
    "q_lora_rank",
    "kv_lora_rank",
    "qk_nope_head_dim",
    "qk_rope_head_dim",
    "v_head_dim",
    # The rope dims' pair layout: the same arrays mean another model under the other one.
    "rope_interleave",
    "weight_dtype",
    "scan_layers",
)
# These change the data stream or the schedule: a resume with other values is
# allowed (extending `steps`, say) but no longer continues the same run.
TRAJECTORY_KEYS = (
    "seed",
    "steps",
    "learning_rate",
    "per_device_batch_size",
    "gradient_accumulation_steps",
    "max_target_length",
    "dataset_type",
    "dataset_path",
    "jsonl_field",
    "tokenizer_path",
    "hf_train_files",
    "train_data_columns",
)


def _quiet_orbax_info(record: logging.LogRecord) -> bool:
    """Orbax logs every save phase at INFO through absl; keep its warnings only."""
    return record.levelno >= logging.WARNING or f"{os.sep}orbax{os.sep}" not in record.pathname


def _serial_array_saves_on_cpu(ocp: Any) -> None:
    """On CPU, save each array from one replica instead of slicing it across replicas.

    Orbax's replica-parallel saving slices every replicated array on device, one
    small compiled program per shape (seconds on a CPU host, at the first save);
    on CPU all "devices" share host memory, so it buys nothing.
    """
    if jax.default_backend() != "cpu":
        return
    handler = ocp.type_handlers.get_type_handler(jax.Array)
    if getattr(handler, "_use_replica_parallel", False):
        ocp.type_handlers.register_type_handler(
            jax.Array,
            ocp.type_handlers.ArrayHandler(
                use_replica_parallel=False,
                array_metadata_store=getattr(handler, "_array_metadata_store", None),
            ),
            override=True,
        )


def warn(message: str) -> None:
    print(f"warning: {message}", file=sys.stderr, flush=True)


def checkpoint_dir(config: Config) -> str | None:
    """Where this run's checkpoints go, or None when checkpointing is off.

    On when `enable_checkpointing` and `base_output_directory` is set: a run
    without an output directory never resumes from, or writes, anything.
    """
    if not (config.enable_checkpointing and config.base_output_directory):
        return None
    return os.path.join(config.run_dir, SUBDIR)


def check_writable(directory: str, key: str = "base_output_directory") -> None:
    """Create `directory` and write a probe file in it, or raise ConfigError (before compiling)."""
    try:
        os.makedirs(directory, exist_ok=True)
        probe = os.path.join(directory, f".write-probe-{uuid.uuid4().hex}")
        with open(probe, "w") as f:
            f.write("ok")
        os.remove(probe)
    except OSError as error:
        raise ConfigError(
            f"{key}: output directory {directory!r} is not writable ({error.strerror or error})"
        ) from None


def is_complete(path: str) -> bool:
    """A step directory orbax finished: its metadata and both items' metadata exist."""
    return all(
        os.path.exists(os.path.join(path, name))
        for name in ("_CHECKPOINT_METADATA", os.path.join("state", "_METADATA"), "meta")
    )


def sweep_incomplete(directory: str) -> list[str]:
    """Warn about (and move aside) every half-written checkpoint; return their paths."""
    if not os.path.isdir(directory):
        return []
    skipped = []
    primary = jax.process_index() == 0
    for name in sorted(os.listdir(directory)):
        path = os.path.join(directory, name)
        if TMP_MARK in name:
            # Orbax's own temporary directory: the manager deletes it on opening.
            warn(f"skipping incomplete checkpoint {path} (an interrupted save); removing it")
            skipped.append(path)
            continue
        if not (name.isdigit() and os.path.isdir(path) and not is_complete(path)):
            continue
        reason = "no completion metadata"
        aside = path + INCOMPLETE
        suffix = 1
        while os.path.exists(aside):
            aside, suffix = f"{path}{INCOMPLETE}{suffix}", suffix + 1
        warn(f"skipping incomplete checkpoint {path} ({reason}); moved to {aside}")
        if primary:
            os.rename(path, aside)
        skipped.append(path)
    return skipped


def _abstract(state: Any, mesh: jax.sharding.Mesh) -> Any:
    """ShapeDtypeStructs carrying each array's sharding: restored arrays land exactly there.

    A leaf not yet placed on the mesh (the fresh step counter lives on one
    device, uncommitted) comes back replicated over the mesh, as the step's
    outputs are.
    """

    def one(x):
        sharding = x.sharding
        if not isinstance(sharding, jax.sharding.NamedSharding):
            sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)

    return jax.tree.map(one, state)


def _config_dict(config: Config) -> dict:
    return dataclasses.asdict(config)


@dataclasses.dataclass
class Restored:
    state: Any
    step: int
    path: str


class Checkpointer:
    """One run's CheckpointManager and its save policy."""

    def __init__(self, config: Config, directory: str, global_batch: int):
        import orbax.checkpoint as ocp

        self._ocp = ocp
        _serial_array_saves_on_cpu(ocp)
        absl_logger = logging.getLogger("absl")
        if _quiet_orbax_info not in absl_logger.filters:
            absl_logger.addFilter(_quiet_orbax_info)
        self.config, self.directory, self.global_batch = config, directory, global_batch
        self.period = config.checkpoint_period
        self.skipped = sweep_incomplete(directory)
        if jax.process_count() > 1:
            # Process 0 moves the incomplete ones aside: nobody lists steps before that.
            from jax.experimental import multihost_utils

            multihost_utils.sync_global_devices("tagtrain: checkpoint sweep")
        options = ocp.CheckpointManagerOptions(
            max_to_keep=config.max_checkpoints_to_keep,
            save_interval_steps=1,  # the policy is `should_save`; saves pass force=True
            enable_async_checkpointing=config.async_checkpointing,
            create=True,
            cleanup_tmp_directories=True,
        )
        self.manager = ocp.CheckpointManager(directory, options=options)
        self.last_saved: int | None = self.manager.latest_step()

    def describe(self) -> str:
        every = f"every {self.period} steps and " if self.period else ""
        mode = "async" if self.config.async_checkpointing else "sync"
        return (
            f"checkpoints: {self.directory} ({every}at the end, {mode}, keep "
            f"{self.config.max_checkpoints_to_keep})"
        )

    def restore_latest(self, state: Any, mesh: jax.sharding.Mesh) -> Restored | None:
        """The newest complete checkpoint in `state`'s shardings, or None when there is none."""
        step = self.manager.latest_step()
        if step is None:
            return None
        ocp = self._ocp
        path = os.path.join(self.directory, str(step))
        meta = self.manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))
        self._check_compatible(meta.meta.get("config", {}), path)
        restored = self.manager.restore(
            step,
            args=ocp.args.Composite(state=ocp.args.StandardRestore(_abstract(state, mesh))),
        )
        return Restored(restored.state, int(step), path)

    def _check_compatible(self, saved: dict, path: str) -> None:
        current = _config_dict(self.config)
        differ = [k for k in MODEL_KEYS if k in saved and saved[k] != current[k]]
        if differ:
            listing = ", ".join(f"{k}={saved[k]!r} (now {current[k]!r})" for k in differ)
            raise ConfigError(
                f"checkpoint {path} was written by a different model: {listing}; "
                "set another run_name or base_output_directory to start fresh"
            )
        changed = [k for k in TRAJECTORY_KEYS if k in saved and saved[k] != current[k]]
        if changed:
            listing = ", ".join(f"{k}={saved[k]!r} (now {current[k]!r})" for k in changed)
            warn(f"resuming from {path} with changed settings: {listing}")

    def should_save(self, step: int) -> bool:
        periodic = self.period > 0 and step % self.period == 0
        return (periodic or step == self.config.steps) and step != self.last_saved

    def save(self, step: int, state: Any) -> bool:
        """Start saving `state` as `step` (async: returns once arrays are copied off device)."""
        if step == self.last_saved:
            return False
        ocp = self._ocp
        meta = {
            "step": step,
            "rows_consumed": step * self.global_batch,
            "config": _config_dict(self.config),
        }
        self.manager.save(
            step,
            args=ocp.args.Composite(
                state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta)
            ),
            force=True,
        )
        self.last_saved = step
        return True

    def wait(self) -> None:
        self.manager.wait_until_finished()

    def close(self) -> None:
        self.manager.close()


def open_checkpointer(config: Config, global_batch: int) -> Checkpointer | None:
    """Check the output directory (ConfigError if not writable) and open the manager."""
    if config.max_checkpoints_to_keep < 1:
        raise ConfigError(f"max_checkpoints_to_keep={config.max_checkpoints_to_keep} must be >= 1")
    if config.checkpoint_period < 0:
        raise ConfigError(
            f"checkpoint_period={config.checkpoint_period} must be >= 0 (0: only at the end)"
        )
    directory = checkpoint_dir(config)
    if directory is None:
        return None
    check_writable(directory)
    return Checkpointer(config, directory, global_batch)


@dataclasses.dataclass
class StopFlag:
    requested: bool = False
    signal_name: str = ""


@contextlib.contextmanager
def stop_on_signals() -> Iterator[StopFlag]:
    """While inside, SIGTERM and a first Ctrl-C (SIGINT) set a flag: the loop
    finishes its step, saves and stops, instead of dying mid-step. A second
    Ctrl-C aborts at once (KeyboardInterrupt), as usual."""
    flag = StopFlag()
    if threading.current_thread() is not threading.main_thread():
        yield flag
        return

    def handler(signum, frame):
        if signum == signal.SIGINT and flag.requested:
            raise KeyboardInterrupt
        flag.requested, flag.signal_name = True, signal.Signals(signum).name
        if signum == signal.SIGINT:
            print(
                "\nCtrl-C: stopping after this step (again to abort)", file=sys.stderr, flush=True
            )

    previous = {sig: signal.signal(sig, handler) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield flag
    finally:
        for sig, old_handler in previous.items():
            signal.signal(sig, old_handler)
