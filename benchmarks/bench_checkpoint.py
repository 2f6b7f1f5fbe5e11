"""Checkpoint save and restore, with and without our checksums (issue 34).

The state of tagtrain-test (issue 34 names deepseek3-test: here that preset is
one MoE layer of the full DeepSeek-V3 width, about 11G parameters before Adam's
two moments, which does not fit a CPU host's memory; tagtrain-test is the
repository's CPU-sized benchmark preset) on 8 virtual CPU devices, data=8,
written to a temporary directory on this host's disk. Timed in one run,
interleaved, median over the rounds after warm-up:

- save, plain: orbax's CheckpointManager async save of the state and the JSON
  metadata, until complete (what the trainer did before checksums);
- save, verified: `Checkpointer.save` until complete: the same orbax save, the
  checksums dispatched on device, read back, recorded, the record read back;
- the time `save` blocks the training loop (until it returns), both ways;
- restore, plain: orbax's restore of both items into the run's shardings;
- restore, verified: `Checkpointer.restore_latest`: the record, the metadata
  checksum, shapes, the same restore, then every array's checksum on device.

Writes benchmarks/results/checkpoint.md and .csv:

    JAX_PLATFORMS=cpu uv run python benchmarks/bench_checkpoint.py
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time

import jax

jax.config.update("jax_num_cpu_devices", 8)

import benchlib as bl  # noqa: E402

COMMAND = "JAX_PLATFORMS=cpu uv run python benchmarks/bench_checkpoint.py"
WARMUP = 1
ROUNDS = int(os.environ.get("BENCH_ROUNDS", "7"))
MODEL = {"model_name": "tagtrain-test", "ici_data_parallelism": "8", "per_device_batch_size": "1"}


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


class Bench:
    """One state, two checkpoint directories: orbax alone and the trainer's Checkpointer."""

    def __init__(self, root: str):
        import orbax.checkpoint as ocp

        from trainer.config import make_config
        from trainer.io import checkpoint, checkpoint_files
        from trainer.run import run as run_lib

        self.ocp = ocp
        config = make_config({**MODEL, "enable_tensorboard": "false"})
        self.run = run_lib.setup(config)  # no base_output_directory: no checkpointer of its own
        self.state, self.mesh = self.run.state, self.run.ctx.mesh
        self.nbytes = sum(x.nbytes for x in jax.tree.leaves(self.state))
        self.meta = {"step": 0, "config": checkpoint._config_dict(config)}
        self.plain_dir = os.path.join(root, "plain")
        options = ocp.CheckpointManagerOptions(max_to_keep=1, enable_async_checkpointing=True)
        self.plain = ocp.CheckpointManager(self.plain_dir, options=options)
        saving = make_config(
            {**MODEL, "base_output_directory": root, "max_checkpoints_to_keep": "1"}
        )
        self.verified = checkpoint.Checkpointer(
            saving, checkpoint_files.checkpoint_dir(saving), self.run.batch_size
        )
        self.step = 0

    def save_plain(self) -> tuple[float, float]:
        """(seconds until save returns, until complete) of orbax's save alone."""
        self.step += 1
        ocp = self.ocp
        args = ocp.args.Composite(
            state=ocp.args.StandardSave(self.state),
            meta=ocp.args.JsonSave({**self.meta, "step": self.step}),
        )
        start = time.perf_counter()
        self.plain.save(self.step, args=args, force=True)
        returned = time.perf_counter() - start
        self.plain.wait_until_finished()
        return returned, time.perf_counter() - start

    def save_verified(self) -> tuple[float, float]:
        self.step += 1
        start = time.perf_counter()
        self.verified.save(self.step, self.state)
        returned = time.perf_counter() - start
        self.verified.wait()
        return returned, time.perf_counter() - start

    def restore_plain(self) -> None:
        from etils import epath

        from trainer.io import checkpoint

        ocp = self.ocp
        path = epath.Path(self.plain_dir) / str(self.plain.latest_step())
        ocp.JsonCheckpointHandler().restore(path / "meta")
        handler = ocp.StandardCheckpointHandler()
        args = ocp.args.StandardRestore(checkpoint._abstract(self.state, self.mesh))
        jax.block_until_ready(handler.restore(path / "state", args=args))
        handler.close()

    def restore_verified(self) -> None:
        restored = self.verified.restore_latest(self.state, self.mesh)
        assert restored is not None, "nothing restored"
        jax.block_until_ready(restored.state)

    def close(self) -> None:
        self.plain.close()
        self.verified.close()


def main() -> None:
    root = tempfile.mkdtemp(prefix="bench-checkpoint-")
    try:
        bench = Bench(root)
        kinds, ways = ("save", "save_blocks", "restore"), ("plain", "verified")
        samples = {(kind, way): [] for kind in kinds for way in ways}
        for round_ in range(WARMUP + ROUNDS):
            for way in ways if round_ % 2 == 0 else reversed(ways):
                blocks, done = getattr(bench, f"save_{way}")()
                restore = _timed(getattr(bench, f"restore_{way}"))
                if round_ >= WARMUP:
                    samples[("save", way)].append(done)
                    samples[("save_blocks", way)].append(blocks)
                    samples[("restore", way)].append(restore)
            print(f"round {round_ + 1}/{WARMUP + ROUNDS}", flush=True)
        bench.close()
        nbytes, leaves = bench.nbytes, len(jax.tree.leaves(bench.state))
    finally:
        shutil.rmtree(root, ignore_errors=True)

    names = {
        "save": "save, until complete",
        "save_blocks": "save, until `save` returns (the loop waits this long)",
        "restore": "restore",
    }
    rows, table_rows = [], []
    for key, label in names.items():
        plain = bl.median(samples[(key, "plain")])
        verified = bl.median(samples[(key, "verified")])
        rows.append({"what": key, "plain_s": plain, "verified_s": verified})
        table_rows.append(
            [label, f"{plain * 1000:,.0f}", f"{verified * 1000:,.0f}", f"{verified / plain:.2f}"]
        )
    notes = [
        f"state: tagtrain-test, params + Adam moments + router biases, "
        f"{bl.mib(nbytes)} MiB (f32), 8 virtual CPU devices, data=8",
        f"median of {ROUNDS} interleaved rounds after {WARMUP} warm-up round "
        "(the warm-up compiles the checksum programs)",
        "plain: orbax alone (CheckpointManager save, StandardCheckpointHandler restore); "
        "verified: trainer.io.checkpoint.Checkpointer (checksums per array, recorded and checked)",
        f"the loop's extra wait in a verified save is dispatching the checksums: one small "
        f"program per array shard held as replica 0 ({leaves} arrays here, all on one device "
        "under data=8), one stack per device, one all-reduce; the hashing itself runs after",
    ]
    lines = bl.header("Checkpoint save and restore, with and without checksums", COMMAND, notes)
    lines += bl.table(["", "plain (ms)", "verified (ms)", "verified / plain"], table_rows)
    bl.write("checkpoint", lines, rows)


if __name__ == "__main__":
    main()
