"""What the compiled verdict costs: once per compile, nothing per step.

For the trainer's step on two shapes, times the parts of a first step:
lowering (with the trace-time analysis as it runs under accum.compile_checked,
which labels the backward pass with source lines to name parameters, and
without that labelling), compiling, running the first step (CPU preset only:
the AOT compile runs nothing), and the check itself (`compiled.as_text()` +
`accum.check_compiled`). The check reads the compiled text once; later steps
call the same executable, so they pay nothing.

- tagtrain-test on 8 virtual CPU devices (data=8, GA=2);
- deepseek3-small AOT-compiled for TPU v5e-8 (needs the tpu extra: libtpu).

Writes benchmarks/results/guard_cost.md:

    JAX_PLATFORMS=cpu uv run --extra tpu python benchmarks/bench_guard_cost.py
"""

from __future__ import annotations

import os
import tempfile
import time

# Several compile-only libtpu clients on one host (as the other AOT benches do).
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)

import benchlib as bl  # noqa: E402

import accum  # noqa: E402
from accum import verdict  # noqa: E402

COMMAND = "JAX_PLATFORMS=cpu uv run --extra tpu python benchmarks/bench_guard_cost.py"
CPU_SHAPE = {"model_name": "tagtrain-test", "ici_data_parallelism": "8", "steps": "1"}
CPU_SHAPE["gradient_accumulation_steps"] = "2"
# Deferred, as auto chose when the page was recorded: at GA=2 auto now ranks
# per_microbatch first (docs/cost_model.md, "Auto"), which has no tags to guard.
CPU_SHAPE["gradient_reduction_policy"] = "deferred"
AOT_SHAPE = {
    "model_name": "deepseek3-small",
    "compile_topology": "v5e-8",
    "ici_data_parallelism": "8",
    "gradient_accumulation_steps": "4",
    "shard_optimizer_over_data": "true",
}


def _timed(fn):
    start = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - start


def _lower_both(build, args_of):
    """(lowered with compile_checked's recording, seconds, seconds without it):
    each from a freshly built step, so neither hits the trace cache. The
    unlabelled one first: the first lowering of a process also pays one-time
    costs (a run with the labelled one first charged them to the labels)."""
    plain_run = build()
    with jax.set_mesh(plain_run.ctx.mesh):
        _, plain = _timed(lambda: plain_run.step_fn.lower(plain_run.state, args_of(plain_run)))
    run = build()
    with jax.set_mesh(run.ctx.mesh), verdict.recording():
        lowered, recorded = _timed(lambda: run.step_fn.lower(run.state, args_of(run)))
    return run, lowered, recorded, plain


def measure_cpu() -> dict:
    from trainer.config import make_config
    from trainer.run import run as run_lib
    from trainer.run import xla_options

    config = make_config({**CPU_SHAPE, "base_output_directory": tempfile.mkdtemp()})
    run, lowered, recorded, plain = _lower_both(
        lambda: run_lib.setup(config), lambda r: run_lib.batch_for(r, 0)
    )
    options = xla_options.for_mesh(config, run.ctx.mesh)
    compiled, compile_s = _timed(lambda: lowered.compile(compiler_options=options))
    batch = run_lib.batch_for(run, 0)
    with jax.set_mesh(run.ctx.mesh):
        _, run_s = _timed(lambda: jax.block_until_ready(compiled(run.state, batch)))
    _, check_s = _timed(lambda: accum.check_compiled(compiled.as_text()))
    return _row("tagtrain-test, 8 CPU devices, GA=2", recorded, plain, compile_s, run_s, check_s)


def measure_aot() -> dict:
    from trainer.config import make_config
    from trainer.run import aot, xla_options
    from trainer.run import run as run_lib

    config = make_config({**AOT_SHAPE, "base_output_directory": tempfile.mkdtemp()})
    topo = aot.choose_topology(config.parallelism)
    devices = aot.devices_for(topo, 1)
    run, lowered, recorded, plain = _lower_both(
        lambda: run_lib.abstract_setup(config, devices), run_lib.abstract_batch
    )
    options = xla_options.for_mesh(config, run.ctx.mesh)
    with jax.set_mesh(run.ctx.mesh):
        compiled, compile_s = _timed(lambda: lowered.compile(compiler_options=options))
    _, check_s = _timed(lambda: accum.check_compiled(compiled.as_text()))
    return _row(
        "deepseek3-small, v5e-8 AOT, ZeRO-1, GA=4", recorded, plain, compile_s, 0.0, check_s
    )


def _row(shape, recorded, plain, compile_s, run_s, check_s) -> dict:
    base = plain + compile_s + run_s
    added = (recorded - plain) + check_s
    return {
        "shape": shape,
        "lower_s (labelled)": f"{recorded:.2f}",
        "lower_s (unlabelled)": f"{plain:.2f}",
        "compile_s": f"{compile_s:.2f}",
        "first_run_s": f"{run_s:.2f}",
        "check_s": f"{check_s:.3f}",
        "added": f"{100 * added / base:.1f}%",
    }


def main() -> int:
    rows = [measure_cpu(), measure_aot()]
    lines = bl.header(
        "The compiled verdict's cost: first step only",
        COMMAND,
        [
            "added = (labelled - unlabelled lowering + check) / (unlabelled lowering + "
            "compile + first run); one measurement each, on a shared 2-core host",
            "later steps call the executable the check read: nothing is added to them",
        ],
    )
    lines += bl.table(list(rows[0]), [list(r.values()) for r in rows])
    bl.write("guard_cost", lines, rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
