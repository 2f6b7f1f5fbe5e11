"""The `train` console script.

    uv run train model_name=tagtrain-tiny steps=10
    uv run train model_name=tagtrain-tiny gradient_accumulation_steps=4 --dump_hlo=/tmp/step.hlo

Positional `key=value` arguments override the config (docs/config.md lists every key);
`--flags` set process-level options.
"""

from __future__ import annotations

import contextlib
import os
import sys

from absl import app, flags

FLAGS = flags.FLAGS
flags.DEFINE_integer(
    "num_cpu_devices",
    8,
    "Virtual CPU devices when the run is on CPU (no accelerator).",
    lower_bound=1,  # absl rejects 0 with a one-line error naming the flag
)
flags.DEFINE_string("dump_hlo", None, "Write the compiled step's HLO text here (for hlo-report).")
flags.DEFINE_string(
    "metrics_file",
    None,
    "One JSON record per step goes here instead of <run_dir>/metrics.jsonl "
    "(records after the run's start step are replaced).",
)
flags.DEFINE_string(
    "coordinator_address", None, "Multi-host: HOST:PORT of process 0 (jax.distributed)."
)
flags.DEFINE_integer("num_processes", None, "Multi-host: number of processes.")
flags.DEFINE_integer("process_id", None, "Multi-host: this process's index.")


# hardware= (MaxText's values) -> JAX's platform name.
PLATFORMS = {"cpu": "cpu", "tpu": "tpu", "gpu": "cuda", "gpu_multiprocess": "cuda"}


def _configure_jax(hardware: str) -> None:
    # Must happen before the first backend use. jax_num_cpu_devices shapes only the
    # CPU backend, so on a machine with accelerators it is harmless.
    import logging

    import jax

    if hardware:
        jax.config.update("jax_platforms", PLATFORMS[hardware])
    jax.config.update("jax_num_cpu_devices", FLAGS.num_cpu_devices)
    # JAX logs at INFO each accelerator backend it probes and does not find ("Unable
    # to initialize backend 'tpu'"), and absl shows INFO: on a CPU host that is noise
    # before the run's own first line. Warnings and errors still show.
    logging.getLogger("jax._src.xla_bridge").setLevel(logging.WARNING)


def _checked_config(argv: list[str]):
    """The config, the launch and the startup notes on MaxText-only arguments, every
    check that needs no backend done; a bad key, value, flag or output directory
    raises ConfigError."""
    # deferred: a bad key or flag is reported before JAX and the model code load
    from trainer.config import ConfigError, make_config
    from trainer.config.maxtext_compat import read_command_line

    overrides, notes = read_command_line(argv[1:])
    config = make_config(overrides)
    if FLAGS.dump_hlo and not os.access(os.path.dirname(os.path.abspath(FLAGS.dump_hlo)), os.W_OK):
        raise ConfigError(f"--dump_hlo directory of {FLAGS.dump_hlo!r} is not writable")
    # deferred: a bad key or flag is reported before JAX and the model code load
    from trainer.io import checkpoint_files, profiling
    from trainer.run import aot
    from trainer.sharding import distributed

    try:
        # Metrics (and AOT's HLO) land here: find out now, not after compiling.
        if FLAGS.metrics_file:
            metrics_dir = os.path.dirname(os.path.abspath(FLAGS.metrics_file))
            checkpoint_files.check_writable(metrics_dir, key="--metrics_file")
        else:
            checkpoint_files.check_writable(config.run_dir, key="base_output_directory")
        profiling.check(config.training, config.output)
        if config.compile_topology:
            aot.choose_topology(config.parallelism)
        if config.gradient_reduction_policy == "auto":
            # deferred: a bad key or flag is reported before JAX and the model code load
            from trainer.step import reduction_choice

            reduction_choice.hardware_for(
                config.parallelism, config.accumulation, []
            )  # ConfigError: unknown or incomplete chip
        launch = distributed.choose_launch(
            FLAGS.coordinator_address,
            FLAGS.num_processes,
            FLAGS.process_id,
            skip=config.skip_jax_distributed_system,
        )
    except ConfigError:
        raise
    except ValueError as error:  # these checks report bad values as plain ValueErrors
        raise ConfigError(str(error)) from error
    return config, launch, notes


def main(argv: list[str]) -> int:
    # deferred: a bad key or flag is reported before JAX and the model code load
    from trainer.config import ConfigError

    # The one config-error path: every check before compiling (and the AOT
    # compile's own) ends here, with exit status 2. Modules are imported as late
    # as before: a bad key is reported before jax and the model code load.
    try:
        config, launch, notes = _checked_config(argv)
        for note in notes:
            print(f"note: {note}", flush=True)
        # deferred: a bad key or flag is reported before JAX and the model code load
        from trainer.io import checkpoint_keys, profiling
        from trainer.run import aot
        from trainer.sharding import distributed

        if config.compile_topology:
            return aot.main(config, FLAGS.dump_hlo)
        _configure_jax(config.hardware)
        distributed.initialize(launch)
        # deferred: a bad key or flag is reported before JAX and the model code load
        from trainer.run import run as run_lib

        try:
            run = run_lib.setup(config)
        except checkpoint_keys.CheckpointRestoreError as error:  # no intact checkpoint to resume
            print(f"error: {error}", file=sys.stderr)
            return 1
    except ConfigError as error:
        print(f"config error: {error}", file=sys.stderr)
        return 2
    # With hf_model_path the preset only fills what config.json does not say.
    source = f" (architecture: {config.hf_model_path}/config.json)" if config.hf_model_path else ""
    print(f"model: {config.model_name}{source}", flush=True)
    run_lib.compile_step(run)
    if FLAGS.dump_hlo:
        with open(FLAGS.dump_hlo, "w") as f:
            f.write(run.compiled.as_text())
        command = run_lib.hlo_report_command(run, FLAGS.dump_hlo)
        print(f"wrote compiled HLO to {FLAGS.dump_hlo} (inspect with: {command})")
    for line in run_lib.startup_lines(run):
        print(line, flush=True)
    if launch.multi_process:
        print(distributed.describe(), flush=True)
    with contextlib.ExitStack() as stack:
        import jax

        # deferred: a bad key or flag is reported before JAX and the model code load
        from trainer.io import metrics as metrics_lib
        from trainer.run import evaluate

        writer = stack.enter_context(
            metrics_lib.MetricsWriter(
                config.run_dir,
                start_step=run.start_step,
                jsonl_path=FLAGS.metrics_file,
                tensorboard=config.enable_tensorboard,
                process_index=jax.process_index(),
            )
        )
        profiler = profiling.Profiler(config.training, config.output, config.run_dir)
        stack.callback(profiler.stop)
        for line in metrics_lib.output_lines(writer, profiler):
            print(line, flush=True)
        profiler.before(run.start_step + 1)

        def on_step(step: int, metrics: dict) -> None:
            profiler.after(step)
            profiler.before(step + 1)
            if step % config.log_period == 0 or step == config.steps:
                line = run_lib.step_line(
                    step, metrics, counted=config.use_sft, aux=run_lib.has_aux_terms(config.model)
                )
                print(line, flush=True)
            writer.write(metrics)

        def on_eval(step: int, result: dict) -> None:
            print(evaluate.eval_line(step, result), flush=True)
            writer.write_eval(step, result)

        if run.start_step >= config.steps:
            print(f"nothing to do: resumed at step {run.start_step}, steps={config.steps}")
        try:
            run_lib.train(run, on_step, on_eval)
        except FloatingPointError as error:
            kept = run.checkpoints.last_saved if run.checkpoints else None
            where = f" (newest checkpoint: step {kept})" if kept else ""
            print(f"error: {error}{where}", file=sys.stderr)
            return 1
        except checkpoint_keys.CheckpointSaveError as error:  # a full or broken disk
            print(f"error: {error}", file=sys.stderr)
            return 1
    if run.stop_reason:
        print(run.stop_reason, flush=True)
    return 0


def run() -> None:
    """Console-script entry point."""
    app.run(lambda argv: sys.exit(main(argv)))
