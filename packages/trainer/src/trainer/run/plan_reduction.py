"""`plan-reduction key=value ... [--compile]`: which reduction policy, before renting a chip.

Takes the trainer's overrides (model_name, compile_topology, num_slices or
compile_topology_num_slices, dcn_*/ici_* parallelism, gradient_accumulation_steps,
per_device_batch_size, ...) and prints, per policy that applies to the mesh, the
cost model's predictions (accum.cost): reduced bytes per step on each link,
exposed communication, accumulator memory, predicted step time, with the policy
gradient_reduction_policy=auto would take marked. The mesh is abstract (no
device, no libtpu). `--compile` compiles each policy for the topology (trainer
AOT, needs libtpu) and prints its compiled memory and the gradient bytes
hlo_tools counts beside the predicted ones.

Its functions take the whole Config: they build the abstract model, choose the
policy and AOT-compile the step, each of which reads every group.
"""

from __future__ import annotations

import dataclasses
import sys
from typing import Any

from trainer.config import Config, ConfigError, make_config, parse_overrides

GIB = 1024**3


def config_of(args: list[str]) -> Config:
    """The config from key=value args; num_slices stands for compile_topology_num_slices."""
    overrides = parse_overrides(args)
    if "num_slices" in overrides and "compile_topology_num_slices" not in overrides:
        overrides["compile_topology_num_slices"] = overrides.pop("num_slices")
    config = make_config(overrides)
    if not config.compile_topology:
        raise ConfigError("plan-reduction needs compile_topology= (e.g. v5p-16, v6e-256)")
    return config


def choice_for(config: Config):
    """(reduction_choice.Choice over every applicable policy, the ShardCtx on an
    abstract mesh of the topology, the trained parameters as ShapeDtypeStructs): auto's
    table whatever gradient_reduction_policy says. No device is touched; with LoRA the
    trained parameters are the adapters, what is reduced."""
    # deferred: the keys are checked before JAX and the model code load
    from trainer.run import aot, spec
    from trainer.step import reduction_choice

    # ConfigError for an unknown topology or a bad mesh
    topo = aot.choose_topology(config.parallelism)
    slices = config.compile_topology_num_slices
    planned = spec.resolve_abstract(config, topo.chips * slices, slices)
    choice = planned.choice or reduction_choice.choose(
        planned.config, planned.ctx, planned.model, planned.trained, planned.devices
    )
    return choice, planned.ctx, planned.trained


def compiled_lines(config: Config, choice: Any, ctx: Any) -> list[str]:
    """AOT-compile each policy; compiled memory and hlo_tools' gradient bytes per axis."""
    # deferred: the keys are checked before JAX and the model code load
    from trainer.run import aot
    from trainer.step import reduction_bytes

    lines = ["compiled (trainer AOT; gradient operand bytes per step, hlo_tools):"]
    for policy in choice.order:
        # each policy's own compile (RunSpec.with_policy is the same act on a resolved spec)
        result = aot.compile_for_topology(
            dataclasses.replace(config, gradient_reduction_policy=policy)
        )
        mesh = dict(result.run.ctx.mesh.shape)
        axes = result.run.plan.batch_axes
        inside, outside = reduction_bytes.counted(result.compiled.as_text(), mesh, axes)
        # None where the cost model made no figure for this policy.
        predicted = choice.costs.get(policy)
        fits = "fits" if result.memory["total"] <= result.hbm_bytes else "DOES NOT FIT"
        lines.append(
            f"  {policy}: {result.memory['total'] / GIB:.3f} GiB per device ({fits}); "
            + "; ".join(
                f"{a}: in loop {inside[a]:,}{_predicted(predicted, 'bytes_in_loop', a)}, "
                f"after {outside[a]:,}{_predicted(predicted, 'bytes_outside', a)}"
                for a in axes
            )
        )
    return lines


def _predicted(cost: Any, field: str, axis: str) -> str:
    """' (predicted N)' from the cost model's figure, or nothing where it made none."""
    return "" if cost is None else f" (predicted {getattr(cost, field)[axis]:,})"


def main(argv: list[str] | None = None) -> int:
    """Console script entry point; exit status 2 on a config error."""
    argv = list(sys.argv[1:] if argv is None else argv)
    compile_too = "--compile" in argv
    args = [a for a in argv if a != "--compile"]
    try:
        config = config_of(args)
        # deferred: the keys are checked before JAX and the model code load
        from trainer.run import report
        from trainer.step import reduction_choice

        choice, ctx, _ = choice_for(config)
    except ConfigError as error:
        print(f"config error: {error}", file=sys.stderr)
        return 2
    slices = config.compile_topology_num_slices
    mesh = ", ".join(f"{a}={n}" for a, n in ctx.mesh.shape.items() if n > 1) or "one device"
    print(
        f"{config.model_name} on {config.compile_topology}"
        + (f" x {slices} slices" if slices > 1 else "")
        + f", mesh {mesh}, GA={config.gradient_accumulation_steps}, "
        f"per_device_batch_size={config.per_device_batch_size:g}"
    )
    for line in report.pipeline_lines(config, dict(ctx.mesh.shape)):
        print(line)
    for line in reduction_choice.startup_lines(choice):
        print(line)
    if not compile_too:
        print("predicted only, nothing compiled (--compile: AOT-compile each policy)")
        return 0
    for line in compiled_lines(config, choice, ctx):
        print(line, flush=True)
    return 0


def run() -> None:
    sys.exit(main())
