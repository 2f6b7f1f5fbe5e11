"""Checkpoints with orbax: periodic async saves, keep the newest N, resume from the newest complete.

A checkpoint is step `N` under `run_dir/checkpoints/N` with two items: `state`
(params, optimizer state, router biases, step: every array of the run's state)
and `meta` (JSON: step, rows of data consumed, the config). The data position
and every random stream follow from (seed, step), so restoring the state
restores the run exactly. A LoRA run's `params` are its adapters; its frozen base
is not saved (NOT_SAVED) but loaded again at every start, as at the first.

This module takes the whole Config: a checkpoint saves all of it, a restart compares
it with the saved one, and the checkpoint directory follows run_dir (output and model).

Orbax writes each save to a temporary directory and renames it only once
complete. Then, in the save's background thread, the run records our own
checksums (trainer.io.checksums: one per array, taken from memory at the save, and
one of the metadata) in `N/tagtrain_checksums.json`, reads that back, and only
then deletes checkpoints beyond `max_checkpoints_to_keep`: an older checkpoint
goes only once a newer one is committed and verified. At startup, a leftover
temporary directory (deleted), or a step directory without orbax's completion
metadata or without our checksums (moved aside to `N.incomplete`, so it cannot
shadow the complete ones), is skipped with a warning naming it.

A restore that fails for any reason (an array that does not read or decode,
metadata that does not parse, a shape or dtype the model does not have (the
optimizer state's float dtypes are cast instead: checkpoint_dtypes.py), a
checksum that does not match) warns naming the step, the item and the cause,
moves the step to `checkpoints/quarantine/N` and tries the next older one; the
run's state is replaced only by a checkpoint that read and verified whole. A
save that fails (no space, lost permission, I/O error) stops the run with
CheckpointSaveError once its leftovers are removed; earlier checkpoints stay.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import errno
import logging
import os
import shutil
from typing import Any

import jax

from trainer.config import Config, ConfigError
from trainer.io import checkpoint_dtypes, checksums
from trainer.io import checkpoint_files as files
from trainer.io.checkpoint_files import (
    CHECKSUMS,
    Damaged,
    is_complete,
    sweep_incomplete,
    warn,
)
from trainer.io.checkpoint_keys import (
    KEY_DEFAULTS,
    MODEL_KEYS,
    NOT_SAVED,
    TRAJECTORY_KEYS,
    CheckpointRestoreError,
    CheckpointSaveError,
)
from trainer.model import pipeline_slots


def _quiet_orbax_info(record: logging.LogRecord) -> bool:
    """Orbax logs every save phase at INFO through absl; keep its warnings only.

    Not its errors either (each with a traceback, several per failure): every
    failed save or restore reaches the run as an exception, reported in one line
    naming the step, the directory and the cause.
    """
    return record.levelno == logging.WARNING or f"{os.sep}orbax{os.sep}" not in record.pathname


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


def _all_processes_ok(ok: bool) -> bool:
    """True when `ok` on every process (each reads its own shards, so one may fail alone)."""
    if jax.process_count() == 1:
        return ok
    import numpy as np
    from jax.experimental import multihost_utils

    return bool(np.all(multihost_utils.process_allgather(np.array([int(ok)], np.int32))))


def persisted(state: dict) -> dict:
    """The part of a run's state a checkpoint holds (all but NOT_SAVED)."""
    return {k: v for k, v in state.items() if k not in NOT_SAVED}


def _state_bytes(state: Any) -> int:
    """What a checkpoint of `state` takes, about: its arrays' bytes, uncompressed."""
    return sum(x.nbytes for x in jax.tree.leaves(state))


def _sync(name: str) -> None:
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices(f"tagtrain: {name}")


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
        # Process 0 moves the incomplete ones aside: nobody lists steps before that.
        _sync("checkpoint sweep")
        options = ocp.CheckpointManagerOptions(
            # Deleting old checkpoints is ours (_finish): only after the newer one is verified.
            max_to_keep=None,
            save_interval_steps=1,  # the policy is `should_save`; saves pass force=True
            enable_async_checkpointing=config.async_checkpointing,
            create=True,
            cleanup_tmp_directories=True,
        )
        self.manager = ocp.CheckpointManager(directory, options=options)
        self.last_saved: int | None = self.manager.latest_step()
        self.checkpoint_bytes = 0  # the state's size, set by check_space and save
        # One save in flight: orbax's async write, then our checksums and clean-up.
        self._finisher = concurrent.futures.ThreadPoolExecutor(1, "tagtrain-checkpoint")
        self._pending: tuple[int, concurrent.futures.Future] | None = None

    def describe(self) -> str:
        every = f"every {self.period} steps and " if self.period else ""
        mode = "async" if self.config.async_checkpointing else "sync"
        return (
            f"checkpoints: {self.directory} ({every}at the end, {mode}, keep "
            f"{self.config.max_checkpoints_to_keep})"
        )

    def check_space(self, state: Any) -> None:
        """Warn when the disk cannot hold max_checkpoints_to_keep + 1 checkpoints of `state`
        (a save writes the new one before the oldest goes)."""
        self.checkpoint_bytes = _state_bytes(persisted(state))
        need = (self.config.max_checkpoints_to_keep + 1) * self.checkpoint_bytes
        free = shutil.disk_usage(self.directory).free
        if free < need:
            warn(
                f"{files.human(free)} free in {self.directory}, below the "
                f"{files.human(need)} that max_checkpoints_to_keep + 1 = "
                f"{self.config.max_checkpoints_to_keep + 1} checkpoints of "
                f"{files.human(self.checkpoint_bytes)} take; a save may fail"
            )

    # Restore.

    def restore_latest(self, state: Any, mesh: jax.sharding.Mesh) -> Restored | None:
        """The newest checkpoint that reads and verifies whole, in `state`'s shardings.

        Each damaged one is reported, moved to quarantine and the next older one
        tried; None when there is no checkpoint, CheckpointRestoreError when none
        of them is intact. ConfigError (another model's checkpoint) is not damage.
        The entries a checkpoint does not hold (NOT_SAVED) come back from `state`.
        """
        # Uneven pipeline stages: the checkpoint holds the real MoE layers only.
        layout = pipeline_slots.config_slots(self.config)
        target = persisted(state)
        restored = self._restore_newest_intact(
            pipeline_slots.stored_abstract(_abstract(target, mesh), layout), mesh
        )
        if restored is not None:
            restored.state = pipeline_slots.to_slots(restored.state, target, layout)
            restored.state = {**restored.state, **{k: state[k] for k in NOT_SAVED if k in state}}
        return restored

    def _restore_newest_intact(self, state: Any, mesh: jax.sharding.Mesh) -> Restored | None:
        tried = []
        for step in files.step_dirs(self.directory):
            path = os.path.join(self.directory, str(step))
            try:
                restored = self._restore_verified(step, path, state, mesh)
            except Damaged as damage:
                aside = self._quarantine(path)
                warn(
                    f"checkpoint step {step} is damaged ({damage.item}: {damage.cause}); "
                    f"moved to {aside}; trying the next older one"
                )
                tried.append(f"{step} ({damage.item}: {damage.cause})")
                continue
            if tried:
                self.manager.reload()  # orbax listed the quarantined steps
            self.last_saved = step
            return restored
        if tried:
            self.manager.reload()
            raise CheckpointRestoreError(
                f"no intact checkpoint in {self.directory}; tried step "
                + "; ".join(tried)
                + f" (moved to {os.path.join(self.directory, files.QUARANTINE)})"
            )
        return None

    def _restore_verified(self, step: int, path: str, state: Any, mesh) -> Restored:
        """Restore step `step` and check it whole, or raise Damaged; the same verdict on
        every process."""
        from etils import epath

        ocp = self._ocp
        # A checkpoint from before checksum records: everything below but the checksums.
        record = None if files.is_unrecorded(path) else files.read_record(path)
        try:
            meta = ocp.JsonCheckpointHandler().restore(epath.Path(path) / "meta")
        except Exception as error:  # any reason: an unreadable item is a damaged checkpoint
            raise Damaged("meta", files.one_line(error)) from None
        if not isinstance(meta, dict):
            raise Damaged("meta", f"a JSON {type(meta).__name__}, not an object")
        if record is not None and checksums.of_json(meta) != record.get("meta_crc32"):
            raise Damaged("meta", "checksum mismatch")
        if meta.get("step") != step:
            raise Damaged("meta", f"says step {meta.get('step')!r}")
        changed = self._check_compatible(meta.get("config", {}), path)
        expected = record.get("arrays", {}) if record is not None else None
        # Read as saved: the optimizer state's float arrays in the saved dtype (cast below).
        reading, casts = (
            (state, {}) if record is None else checkpoint_dtypes.as_saved(state, expected)
        )
        # Each process reads its own shards: agree before anyone goes on.
        handler = ocp.StandardCheckpointHandler()
        try:
            args = ocp.args.StandardRestore(_abstract(reading, mesh))
            restored, failure = handler.restore(epath.Path(path) / "state", args=args), None
        except Exception as error:  # any reason: it is not used
            restored, failure = None, files.one_line(error)
        finally:
            handler.close()
        if not _all_processes_ok(failure is None):
            raise Damaged("state", failure or "failed to read on another process (see its log)")
        for name, got in checksums.of_tree(restored).items() if record is not None else ():
            if got != expected[name]["sum"]:
                raise Damaged(f"state/{name}", "checksum mismatch")
        if record is None:
            warn(
                f"checkpoint step {step} has no checksum record (saved before tagtrain "
                "recorded them): read whole, not checksum-verified"
            )
        if casts:  # mu_dtype / nu_dtype changed since the save
            restored = checkpoint_dtypes.cast_like(restored, state)
            warn(
                f"checkpoint step {step}: {checkpoint_dtypes.describe(casts)} (mu_dtype, nu_dtype)"
            )
        if changed:  # only now: a damaged checkpoint is not the one resumed from
            warn(f"resuming from {path} with changed settings: {changed}")
        return Restored(restored, step, path)

    def _quarantine(self, path: str) -> str:
        """Move a damaged step directory to quarantine/ (kept for the user); returns where."""
        # Every process is done reading it first: a rename under a slower process's
        # read would give that one another verdict, and another sequence of collectives.
        _sync("checkpoint verdict")
        aside = files.unused_path(
            os.path.join(self.directory, files.QUARANTINE, os.path.basename(path))
        )
        if jax.process_index() == 0:
            os.makedirs(os.path.dirname(aside), exist_ok=True)
            os.rename(path, aside)
        _sync("checkpoint quarantine")
        return aside

    def _check_compatible(self, saved: dict, path: str) -> str:
        """ConfigError when `saved` is another model's config; else the trajectory keys
        that changed, listed ("" when none)."""
        current = _config_dict(self.config)
        saved = {**KEY_DEFAULTS, **saved}
        differ = [k for k in MODEL_KEYS if k in saved and saved[k] != current[k]]
        if differ:
            listing = ", ".join(f"{k}={saved[k]!r} (now {current[k]!r})" for k in differ)
            raise ConfigError(
                f"checkpoint {path} was written by a different model: {listing}; "
                "set another run_name or base_output_directory to start fresh"
            )
        changed = [k for k in TRAJECTORY_KEYS if k in saved and saved[k] != current[k]]
        return ", ".join(f"{k}={saved[k]!r} (now {current[k]!r})" for k in changed)

    # Save.

    def should_save(self, step: int) -> bool:
        periodic = self.period > 0 and step % self.period == 0
        return (periodic or step == self.config.steps) and step != self.last_saved

    def save(self, step: int, state: Any) -> bool:
        """Start saving `state` as `step` (async: returns once arrays are copied off device).

        Waits for the previous save to finish first (orbax would too); raises
        CheckpointSaveError when that one, or this one's start, failed.
        """
        if step == self.last_saved:
            return False
        self.wait()
        # Uneven pipeline stages: the real MoE layers only, not the padded stack's
        # slots, so the checkpoint resumes on any stage count.
        state = pipeline_slots.to_stored(persisted(state), pipeline_slots.config_slots(self.config))
        ocp = self._ocp
        meta = {
            "step": step,
            "rows_consumed": step * self.global_batch,
            "config": _config_dict(self.config),
            files.RECORDED: True,  # a record follows: without it this save was cut short
        }
        self.checkpoint_bytes = _state_bytes(state)  # for the error, should this one fail
        # Dispatched now, read in the background: the next step does not wait for them.
        sums, shapes = checksums.start(state), checksums.shapes(state)
        try:
            self.manager.save(
                step,
                args=ocp.args.Composite(
                    state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta)
                ),
                force=True,
            )
        except Exception as error:  # any reason: the run must not go on without saving
            self._failed(step, error)
        self.last_saved = step
        future = self._finisher.submit(self._finish, step, sums, shapes, meta)
        self._pending = (step, future)
        return True

    def _finish(self, step: int, sums: Any, shapes: dict, meta: dict) -> None:
        """In the background: wait for orbax's write, record our checksums, read them
        back, then delete the checkpoints beyond max_checkpoints_to_keep."""
        self.manager.wait_until_finished()
        self.manager.check_for_errors()
        values = checksums.values(sums, list(shapes))
        if jax.process_index() != 0:
            return
        path = os.path.join(self.directory, str(step))
        if not files.orbax_complete(path):
            raise OSError(errno.EIO, "orbax reported success but the step is incomplete", path)
        arrays = {
            name: {"shape": shape, "dtype": dtype, "sum": values[name]}
            for name, (shape, dtype) in shapes.items()
        }
        body = {
            "step": step,
            "meta_crc32": checksums.of_json(meta),
            "arrays": arrays,
            "checksum": "trainer.io.checksums: fmix32 sums over elements, 2 lanes",
        }
        files.write_json_atomic(os.path.join(path, CHECKSUMS), files.sealed(body))
        files.read_record(path)  # verified: what a restore will read
        self._delete_old(step)

    def _delete_old(self, newest: int) -> None:
        """Keep the newest max_checkpoints_to_keep complete steps up to `newest`; delete
        older ones (quarantined and incomplete ones are elsewhere, untouched)."""
        kept = 0
        for step in files.step_dirs(self.directory):
            path = os.path.join(self.directory, str(step))
            if step > newest:
                continue
            if kept < self.config.max_checkpoints_to_keep and is_complete(path):
                kept += 1
                continue
            shutil.rmtree(path, ignore_errors=True)

    def _failed(self, step: int, error: BaseException):
        """Remove what the failed save of `step` left, then raise CheckpointSaveError."""
        with contextlib.suppress(Exception):
            self.manager.wait_until_finished()
        if jax.process_index() == 0 and os.path.isdir(self.directory):
            for name in os.listdir(self.directory):
                leftover = name == str(step) or name.startswith(f"{step}{files.TMP_MARK}")
                path = os.path.join(self.directory, name)
                if leftover and not is_complete(path):
                    files.remove_when_quiet(path)
        with contextlib.suppress(Exception):
            self.manager.reload()
        self.last_saved = None
        kept = [
            s
            for s in files.step_dirs(self.directory)
            if is_complete(os.path.join(self.directory, str(s)))
        ]
        try:
            free = f", {files.human(shutil.disk_usage(self.directory).free)} free there"
        except OSError:
            free = ""
        need = self.checkpoint_bytes
        kept_text = f"steps {', '.join(map(str, sorted(kept)))}" if kept else "none"
        raise CheckpointSaveError(
            f"saving checkpoint step {step} in {self.directory} failed ({files.one_line(error)}); "
            f"a checkpoint needs about {files.human(need)} ({need} bytes){free}; "
            f"earlier checkpoints kept: {kept_text}"
        ) from error

    def raise_if_failed(self) -> None:
        """Raise CheckpointSaveError if the save in flight has failed (never waits)."""
        if self._pending and self._pending[1].done():
            self.wait()

    def wait(self) -> None:
        """Wait for the save in flight; CheckpointSaveError if it failed."""
        if not self._pending:
            return
        step, future = self._pending
        self._pending = None
        try:
            future.result()
        except Exception as error:  # any reason: report it as a failed save
            self._failed(step, error)

    def close(self) -> None:
        try:
            self.wait()
        finally:
            self._finisher.shutdown()
            self.manager.close()


def open_checkpointer(config: Config, global_batch: int) -> Checkpointer | None:
    """Check the output directory (ConfigError if not writable) and open the manager."""
    if config.max_checkpoints_to_keep < 1:
        raise ConfigError(f"max_checkpoints_to_keep={config.max_checkpoints_to_keep} must be >= 1")
    if config.checkpoint_period < 0:
        raise ConfigError(
            f"checkpoint_period={config.checkpoint_period} must be >= 0 (0: only at the end)"
        )
    directory = files.checkpoint_dir(config)
    if directory is None:
        return None
    files.check_writable(directory)
    return Checkpointer(config, directory, global_batch)
