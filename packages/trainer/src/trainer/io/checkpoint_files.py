"""A checkpoint directory on disk: where it is (`checkpoint_dir`, always absolute), that
it is writable, its step directories, when one is complete, our checksum
record in it, moving one aside, and removing what a failed save left.

Layout: `checkpoints/N/` (orbax's items `state` and `meta`, then our
`tagtrain_checksums.json`, written last), `checkpoints/N.incomplete` (a save
that never finished, moved aside at start-up), `checkpoints/quarantine/N` (a
checkpoint that failed to restore), `N.orbax-checkpoint-tmp*` (a save in flight).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import sys
import time
import uuid
import zlib

import jax

from trainer.config import Config, ConfigError
from trainer.io.checkpoint_keys import SUBDIR

TMP_MARK = ".orbax-checkpoint-tmp"
INCOMPLETE = ".incomplete"
QUARANTINE = "quarantine"  # damaged checkpoints go here, under the checkpoint directory
CHECKSUMS = "tagtrain_checksums.json"  # our record in each step directory; written last


class Damaged(Exception):
    """One checkpoint failed to restore: `item` (meta, state, state/NAME, checksums) and why."""

    def __init__(self, item: str, cause: str):
        super().__init__(f"{item}: {cause}")
        self.item, self.cause = item, cause


def one_line(error: BaseException) -> str:
    """The cause of `error` in one line: an OSError found in its chain, else the first line
    of the innermost error (orbax wraps the one that names the array and the file)."""
    chain = [error]
    while len(chain) < 20:
        last = chain[-1]
        inner = last.__cause__ or (None if last.__suppress_context__ else last.__context__)
        if inner is None:
            break
        chain.append(inner)
    for seen in chain:
        if isinstance(seen, OSError) and seen.errno:
            where = f": {seen.filename}" if seen.filename else ""
            return f"{seen.strerror or os.strerror(seen.errno)}{where}"
    root = chain[-1]
    text = str(root).strip().splitlines()
    first = text[0] if text else ""
    return f"{type(root).__name__}: {first[:300]}"


def human(nbytes: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if nbytes < 1024 or unit == "TiB":
            return f"{nbytes:.1f} {unit}" if unit != "B" else f"{int(nbytes)} B"
        nbytes /= 1024
    raise AssertionError("unreachable")


def warn(message: str) -> None:
    print(f"warning: {message}", file=sys.stderr, flush=True)


def orbax_complete(path: str) -> bool:
    """Orbax finished this step directory: its metadata and both items' metadata exist."""
    return all(
        os.path.exists(os.path.join(path, name))
        for name in ("_CHECKPOINT_METADATA", os.path.join("state", "_METADATA"), "meta")
    )


# The meta item's key saying a checksum record belongs to this checkpoint: a save
# that stopped before writing the record is told from one made before records existed.
RECORDED = "checksums"


def is_unrecorded(path: str) -> bool:
    """An orbax-complete step saved before tagtrain recorded checksums: no record, and
    a meta item that does not promise one. Restored unverified (read whole, shapes
    checked by orbax) rather than moved aside, so an upgrade does not restart a run."""
    if not orbax_complete(path) or os.path.exists(os.path.join(path, CHECKSUMS)):
        return False
    try:
        with open(os.path.join(path, "meta", "metadata")) as f:
            meta = json.load(f)
    except (OSError, ValueError):
        return False
    return isinstance(meta, dict) and RECORDED not in meta


def is_complete(path: str) -> bool:
    """A step directory whose save finished: orbax's metadata and our checksums exist
    (or it predates checksum records: is_unrecorded)."""
    if not orbax_complete(path):
        return False
    return os.path.exists(os.path.join(path, CHECKSUMS)) or is_unrecorded(path)


def unused_path(path: str) -> str:
    """`path` if free, else `path.1`, `path.2`, ...: where to move something without overwriting."""
    candidate, suffix = path, 1
    while os.path.exists(candidate):
        candidate, suffix = f"{path}.{suffix}", suffix + 1
    return candidate


def step_dirs(directory: str) -> list[int]:
    """The step numbers of `directory`'s step directories, newest first."""
    if not os.path.isdir(directory):
        return []
    names = os.listdir(directory)
    return sorted((int(n) for n in names if n.isdigit()), reverse=True)


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
        if orbax_complete(path):
            reason = "no checksums recorded: the save stopped before they were written"
        else:
            reason = "no completion metadata"
        moved_to = unused_path(path + INCOMPLETE)
        warn(f"skipping incomplete checkpoint {path} ({reason}); moved to {moved_to}")
        if primary:
            os.rename(path, moved_to)
        skipped.append(path)
    return skipped


def write_json_atomic(path: str, record: dict) -> None:
    """Write `record` to `path` so that a reader sees all of it or nothing."""
    partial = f"{path}.partial-{uuid.uuid4().hex}"
    with open(partial, "w") as f:
        json.dump(record, f, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    os.replace(partial, path)


def sealed(body: dict) -> dict:
    """`body` with a crc32 of itself: a damaged record is told from a damaged checkpoint."""
    return {**body, "crc32": zlib.crc32(json.dumps(body, sort_keys=True).encode())}


def read_record(path: str) -> dict:
    """The checksum record of the step directory `path`; Damaged("checksums", ...) if unreadable."""
    try:
        with open(os.path.join(path, CHECKSUMS)) as f:
            record = json.load(f)
        body = {k: v for k, v in record.items() if k != "crc32"}
        intact = sealed(body)["crc32"] == record.get("crc32")
    except (OSError, ValueError, AttributeError) as error:
        raise Damaged("checksums", one_line(error)) from None
    if not intact:
        raise Damaged("checksums", f"{CHECKSUMS} does not match its own crc32")
    return record


def tree_listing(path: str) -> list[tuple[str, int]]:
    listing = []
    for root, _, files in os.walk(path):
        for name in files:
            with contextlib.suppress(OSError):
                listing.append(
                    (os.path.join(root, name), os.path.getsize(os.path.join(root, name)))
                )
    return sorted(listing)


def remove_when_quiet(path: str, settle_s: float = 0.2, limit_s: float = 60.0) -> None:
    """Delete what a failed save left at `path`, once nothing writes there any more.

    When one of orbax's writes fails, it reports the save as failed at once while
    its other writes (the arrays, in tensorstore's threads) may still be running and
    would create files again after a plain delete.
    """
    deadline = time.monotonic() + limit_s
    while os.path.exists(path) and time.monotonic() < deadline:
        before = tree_listing(path)
        time.sleep(settle_s)
        if tree_listing(path) == before:
            shutil.rmtree(path, ignore_errors=True)


def checkpoint_dir(config: Config) -> str | None:
    """Where this run's checkpoints go, or None when checkpointing is off.

    On when `enable_checkpointing` and `base_output_directory` is set: a run
    without an output directory never resumes from, or writes, anything.
    """
    if not (config.enable_checkpointing and config.base_output_directory):
        return None
    # Absolute: orbax refuses a relative path, and only when it first saves (after
    # the whole run); `base_output_directory=outputs` means the working directory's.
    return os.path.abspath(os.path.join(config.run_dir, SUBDIR))


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
