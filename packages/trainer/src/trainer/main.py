"""The `train` console script.

    uv run train model_name=deepseek3-tiny steps=10
    uv run train model_name=deepseek3-tiny gradient_accumulation_steps=4 --dump_hlo=/tmp/step.hlo

Positional `key=value` arguments override the config (see trainer/config.py);
`--flags` set process-level options.
"""

from __future__ import annotations

import contextlib
import os
import sys

from absl import app, flags

FLAGS = flags.FLAGS
flags.DEFINE_integer(
    "num_cpu_devices", 8, "Virtual CPU devices when the run is on CPU (no accelerator)."
)
flags.DEFINE_string("dump_hlo", None, "Write the compiled step's HLO text here (for hlo-report).")
flags.DEFINE_string("metrics_file", None, "Append one JSON record per step to this file.")


def _configure_jax() -> None:
    # Must happen before the first backend use. It shapes only the CPU backend, so
    # on a machine with accelerators it is harmless.
    import jax

    jax.config.update("jax_num_cpu_devices", FLAGS.num_cpu_devices)


def main(argv: list[str]) -> int:
    from trainer.config import ConfigError, make_config, parse_overrides

    try:
        config = make_config(parse_overrides(argv[1:]))
    except ConfigError as error:
        print(f"config error: {error}", file=sys.stderr)
        return 2
    if FLAGS.dump_hlo and not os.access(os.path.dirname(os.path.abspath(FLAGS.dump_hlo)), os.W_OK):
        print(
            f"config error: --dump_hlo directory of {FLAGS.dump_hlo!r} is not writable",
            file=sys.stderr,
        )
        return 2
    _configure_jax()
    from trainer import run as run_lib

    try:
        run = run_lib.setup(config)
    except ConfigError as error:
        print(f"config error: {error}", file=sys.stderr)
        return 2
    print(f"model: {config.model_name}", flush=True)
    run_lib.compile_step(run)
    if FLAGS.dump_hlo:
        with open(FLAGS.dump_hlo, "w") as f:
            f.write(run.compiled.as_text())
        print(f"wrote compiled HLO to {FLAGS.dump_hlo} (inspect with: hlo-report {FLAGS.dump_hlo})")
    for line in run_lib.startup_lines(run):
        print(line, flush=True)
    with contextlib.ExitStack() as stack:
        metrics_out = (
            stack.enter_context(open(FLAGS.metrics_file, "a")) if FLAGS.metrics_file else None
        )

        def on_step(step: int, metrics: dict) -> None:
            if step % config.log_period == 0 or step == config.steps:
                print(run_lib.step_line(step, metrics), flush=True)
            if metrics_out:
                metrics_out.write(run_lib.metrics_json(metrics) + "\n")
                metrics_out.flush()

        if run.start_step >= config.steps:
            print(f"nothing to do: resumed at step {run.start_step}, steps={config.steps}")
        try:
            run_lib.train(run, on_step)
        except FloatingPointError as error:
            kept = run.checkpoints.last_saved if run.checkpoints else None
            where = f" (newest checkpoint: step {kept})" if kept else ""
            print(f"error: {error}{where}", file=sys.stderr)
            return 1
    if run.stop_reason:
        print(run.stop_reason, flush=True)
    return 0


def run() -> None:
    """Console-script entry point."""
    app.run(lambda argv: sys.exit(main(argv)))
