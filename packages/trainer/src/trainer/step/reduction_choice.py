"""`gradient_reduction_policy=auto`: the policy the cost model (accum.cost) predicts fastest.

Every policy that applies to the mesh gets a plan and a predicted cost; they are
ranked by predicted step time (ties: the smaller accumulator), deferred first unless
another is predicted faster by more than DEFERRED_MARGIN (10%). The first in that
order is built and compiled; where the chip's HBM is known (a compile_topology,
or a device that reports its memory limit) and the compiled step does not fit,
the next one is tried and the skipped one named (`compile_first_fitting`). The startup
lines show the table with the chosen row marked.

Fixed rules, before the model: shard_mode=auto places reductions by XLA (the
policy is moot: deferred, as before); one microbatch has nothing to accumulate
(deferred: the plans differ only in where the one reduction runs); on several
slices per_microbatch is ranked after hierarchical whatever the figures say
(it moves every microbatch's gradient over DCN).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import numpy as np

import accum
from accum import cost as cost_lib
from accum.hardware import HARDWARE, Hardware, HardwareError, hardware
from trainer import model as model_lib
from trainer.config import (
    AccumulationConfig,
    Config,
    ConfigError,
    DataConfig,
    ModelConfig,
    ParallelismConfig,
)
from trainer.config.pipeline import stage_count
from trainer.model import flops
from trainer.sharding import reduction_plan
from trainer.step import pipeline_cost

GIB = 1024**3
# Device kinds (jax `device_kind` prefixes) -> hardware table entries.
DEVICE_KINDS = {
    "TPU v5 lite": "v5e",
    "TPU v5e": "v5e",
    "TPU v5p": "v5p",
    "TPU v5": "v5p",
    "TPU v6": "v6e",
    "TPU v4": "v4",
    "NVIDIA H100": "h100",
    "NVIDIA H200": "h200",
}
# Where no table entry describes the devices (CPU): the ranking then rests on the
# bytes per link, scaled by these figures. Said in the startup line.
ASSUMED = "v5e"


@dataclasses.dataclass(frozen=True)
class Choice:
    """What auto decided: the policies in the order to try, their predictions, and why."""

    order: tuple[str, ...]
    costs: dict[str, cost_lib.Cost]
    hardware: Hardware | None
    note: str  # what was assumed or why the model was not consulted
    skipped: tuple[str, ...] = ()  # (policy: reason) lines, filled by next_choice
    # False in shard_mode=auto: XLA places every reduction, no policy applies (the
    # config still carries deferred, the value every consumer of a plan expects).
    applies: bool = True
    # With pipeline stages: what they add (step/pipeline_cost.py), already in `costs`.
    pipeline: pipeline_cost.PipelineCost | None = None

    @property
    def policy(self) -> str:
        return self.order[0]


def hardware_for(
    parallelism: ParallelismConfig, accumulation: AccumulationConfig, devices: list
) -> tuple[Hardware, str]:
    """The table entry for this run and a note on where it came from.

    `reduction_hardware` wins, then the compile_topology's chip, then the
    devices' kind; CPU (no entry) assumes ASSUMED's figures. ConfigError, naming
    what to change, for an unknown or incomplete entry."""
    if accumulation.reduction_hardware:
        name, source = (
            accumulation.reduction_hardware,
            f"reduction_hardware={accumulation.reduction_hardware}",
        )
    elif parallelism.compile_topology:
        name, source = (
            parallelism.compile_topology,
            f"compile_topology={parallelism.compile_topology}",
        )
    else:
        kind = getattr(devices[0], "device_kind", "") if devices else ""
        name = next((v for k, v in DEVICE_KINDS.items() if kind.startswith(k)), None)
        if name is None:
            return HARDWARE[ASSUMED], (
                f"no hardware table entry for {kind or 'these devices'!r}: assumed {ASSUMED}'s "
                "figures; set reduction_hardware= to model another chip"
            )
        source = f"devices: {kind}"
    try:
        entry = hardware(name)
        return entry, f"{entry.name} figures, from {source}"
    except HardwareError as error:
        raise ConfigError(
            f"gradient_reduction_policy=auto: {error}; or set gradient_reduction_policy="
            "deferred|per_microbatch|hierarchical, or reduction_hardware= another chip"
        ) from error


def step_flops_per_chip(
    model: ModelConfig, accumulation: AccumulationConfig, data: DataConfig
) -> float:
    """Training FLOPs of one optimizer step on one chip (trainer.model.flops' formula)."""
    tokens = data.per_device_batch_size * data.max_target_length
    return (
        flops.training_flops_per_token(model, data)
        * tokens
        * accumulation.gradient_accumulation_steps
    )


def plans(
    parallelism: ParallelismConfig, accumulation: AccumulationConfig, ctx: Any, params: Any
) -> dict[str, accum.ReductionPlan]:
    """A plan per policy that applies to this mesh and to the schedule: those accum
    refuses (`reduction_plan`'s ConfigError, accum's rule) are left out."""
    out = {}
    for policy in accum.POLICIES:
        candidate = dataclasses.replace(accumulation, gradient_reduction_policy=policy)
        try:
            out[policy] = reduction_plan(parallelism, candidate, ctx, params)
        except ConfigError:
            continue
    return out


class GradientTraits(NamedTuple):
    """accum.cost's `gradient_dtypes`, `use_dtypes` and `summed_in_use` trees of one
    model: how its uses shape each leaf's per-microbatch reduction; and which
    leaves are stacked on a leading 'layers' axis (`loop_sums` reads it)."""

    backward: Any
    at_use: Any
    summed_in_use: Any
    layer_stacked: Any


def gradient_traits(model: Any, params: Any) -> GradientTraits:
    """Per parameter leaf, the dtype of its gradient in the backward pass where it is
    not the compute dtype (None there): a parameter the model uses in its own dtype
    (params.CAST_AT_USE false: norm scales, the embedding table) has a cotangent of
    that dtype, which is what its per-microbatch reductions carry; the dtype its use
    computes in where the model casts it up again (params.USE_DTYPE: the router's
    gate, in f32), which is what autodiff's per-microbatch reduction carries; and
    whether its use sums its copy's cotangent in a shard_map (params.SUMMED_IN_USE:
    the embedding table's lookup); and whether it is stacked per layer (its logical
    axes lead with 'layers', 'stage_layers' for the pipelined stack)."""
    backward = jax.tree.map(
        lambda cast, x: None if cast else x.dtype,
        model.param_cast_at_use,
        params,
    )
    at_use = jax.tree.map(
        lambda use, x: None if use is None else np.dtype(use),
        model.param_use_dtype,
        params,
        is_leaf=lambda x: x is None,
    )
    stacked = jax.tree.map(
        lambda axes: axes[:1] in (("layers",), ("stage_layers",)),
        model.param_logical,
        is_leaf=lambda x: isinstance(x, tuple),
    )
    return GradientTraits(backward, at_use, model.param_summed_in_use, stacked)


def summed_by_the_loop(stacked: bool, layers: int, scatters: bool, fused_in_scan: bool) -> bool:
    """Whether XLA moves a leaf's per-microbatch reductions after the microbatch loop
    (docs/cost_model.md, "What XLA moves"): the loop must only sum its reduced
    gradient. A gradient stacked per layer (`stacked`) of more than one layer
    (`layers`, its leading dimension) comes out of the backward layer loop, scanned
    or unrolled (scan_layers), stacked, not summed: it stays. A one-layer stack's
    gradient is summed like the others', unless accumulation is fused into the layer
    scan (`fused_in_scan`), whose body adds it into the accumulator's layer slice.
    accum's own per-microbatch reduce-scatters (`scatters`: hierarchical) move only
    under the fused schedule; the plain schedule's add of the scattered tree keeps
    every one in the loop."""
    if scatters and not fused_in_scan:
        return False
    if not stacked:
        return True
    return layers == 1 and not fused_in_scan


def fuses_in_scan(model: ModelConfig, accumulation: AccumulationConfig, plan: Any) -> bool:
    """Whether accumulation runs inside the backward layer scan: accum's decision
    (`accum.fuses_in_scan`) for this schedule, plan, microbatch count and model."""
    return accum.fuses_in_scan(
        accumulation.gradient_accumulation_schedule,
        plan,
        accumulation.gradient_accumulation_steps,
        scans_layers=model.scan_layers,
    )


def loop_sums(
    traits: GradientTraits,
    params: Any,
    plan: Any,
    model: ModelConfig,
    accumulation: AccumulationConfig,
) -> Any:
    """accum.cost's `summed_by_the_loop` tree for `plan`: `summed_by_the_loop` per leaf."""
    fused = fuses_in_scan(model, accumulation, plan)
    return plan.map(
        lambda leaf, stacked, x: summed_by_the_loop(
            stacked, x.shape[0] if x.shape else 1, bool(leaf.scatter), fused
        ),
        traits.layer_stacked,
        params,
    )


def cost_inputs(
    traits: GradientTraits | None,
    params: Any,
    plan: Any,
    model: ModelConfig,
    parallelism: ParallelismConfig,
    accumulation: AccumulationConfig,
) -> dict[str, Any]:
    """accum.cost's keyword arguments (plan_events, predict) for `plan` from the
    model's `gradient_traits` (None: every leaf in the compute dtype, nothing moved)
    and the run's groups: where accumulation runs (`loop_sums`) and whether the
    optimizer state is sharded over the data axes (ZeRO-1: shard_optimizer_over_data)."""
    zero1 = parallelism.shard_optimizer_over_data
    if traits is None:
        return {"zero1": zero1}
    return {
        "zero1": zero1,
        "gradient_dtypes": traits.backward,
        "use_dtypes": traits.at_use,
        "summed_in_use": traits.summed_in_use,
        "summed_by_the_loop": loop_sums(traits, params, plan, model, accumulation),
        "stacked_per_layer": traits.layer_stacked,
    }


def predict_all(
    model: ModelConfig,
    parallelism: ParallelismConfig,
    accumulation: AccumulationConfig,
    data: DataConfig,
    candidates: dict[str, accum.ReductionPlan],
    params: Any,
    hw: Hardware,
    grad_dtypes: Any = None,
    step_flops: float | None = None,
) -> dict[str, cost_lib.Cost]:
    """accum.cost.predict for each candidate plan (`grad_dtypes`: `gradient_traits`;
    `step_flops`: the step's FLOPs per chip where not `step_flops_per_chip`'s, as with
    pipeline stages)."""
    if step_flops is None:
        step_flops = step_flops_per_chip(model, accumulation, data)
    return {
        policy: cost_lib.predict(
            plan,
            params,
            num_microbatches=accumulation.gradient_accumulation_steps,
            hardware=hw,
            step_flops_per_chip=step_flops,
            compute_dtype=model.dtype,
            accum_dtype=accumulation.accum_dtype,
            # Only rings run async under the last backward (aot_async.md).
            overlapped_after_loop=accumulation.gradient_accumulation_schedule == "overlapped_ring",
            **cost_inputs(grad_dtypes, params, plan, model, parallelism, accumulation),
        )
        for policy, plan in candidates.items()
    }


# The time model has no per-collective term (each collective's launch latency), and
# the other policies issue more collectives than deferred: per_microbatch GA times
# its reductions, hierarchical GA times its in-slice ones. Where the model predicts
# a tie the benchmark measures deferred ahead (benchmarks/results/deferral.md, the
# GA=1 row), so another policy displaces deferred only when predicted faster by more
# than this share of deferred's step time.
DEFERRED_MARGIN = 0.10


def rank(costs: dict[str, cost_lib.Cost], across_slices: bool) -> tuple[str, ...]:
    """Policies by predicted step time, then accumulator memory; deferred first unless
    beaten by more than DEFERRED_MARGIN; per_microbatch after hierarchical when the
    mesh spans slices."""
    order = sorted(costs, key=lambda p: (costs[p].step_seconds, costs[p].accumulator_bytes))
    if "deferred" in costs and order[0] != "deferred":
        best, deferred = costs[order[0]].step_seconds, costs["deferred"].step_seconds
        if best > (1 - DEFERRED_MARGIN) * deferred:
            order.remove("deferred")
            order.insert(0, "deferred")
    if across_slices and "hierarchical" in order and "per_microbatch" in order:
        order.remove("per_microbatch")
        order.insert(order.index("hierarchical") + 1, "per_microbatch")
    return tuple(order)


def choose(config: Config, ctx: Any, model: Any, params: Any, devices: list | tuple) -> Choice:
    """gradient_reduction_policy=auto's decision for the trained `params` (compute
    layout) of `model` (a ModelDef) on `ctx`'s mesh: accum.cost's ranking of every
    policy that applies, with the model's gradient traits. Takes the Config: the cost
    model reads the model, parallelism, accumulation and data groups."""
    staged = stage_count(config) > 1
    parallelism, accumulation = config.parallelism, config.accumulation
    trained = model_lib.trained_view(model)
    if config.shard_mode != "explicit":
        note = "shard_mode=auto: XLA places every reduction"
        pipe = None
        if staged:  # the stages' own terms still apply
            hw, _ = hardware_for(parallelism, accumulation, list(devices))
            pipe = stage_terms(config, ctx, trained, params, hw)
        return Choice(("deferred",), {}, None, note, applies=False, pipeline=pipe)
    hw, note = hardware_for(parallelism, accumulation, list(devices))
    grad_dtypes = gradient_traits(trained, params)
    if staged:
        return staged_choice(config, ctx, trained, params, hw, note, grad_dtypes)
    candidates = plans(parallelism, accumulation, ctx, params)
    costs = predict_all(
        config.model, parallelism, accumulation, config.data, candidates, params, hw, grad_dtypes
    )
    order = auto_order(costs, candidates, config.gradient_accumulation_steps)
    if config.gradient_accumulation_steps == 1:
        note += "; one microbatch: deferred (nothing to accumulate, whatever the figures)"
    return Choice(order, costs, hw, note)


def stage_terms(
    config: Config, ctx: Any, trained: Any, params: Any, hw: Hardware
) -> pipeline_cost.PipelineCost:
    """What the stage axis adds to the step (step/pipeline_cost.py) for the `trained`
    model view's `params` on `ctx`'s mesh, priced with `hw`."""
    p, r = stage_count(config), config.num_pipeline_repeats
    # Circular stages move every stacked leaf to its stage (the router biases too) and
    # send the trained ones' gradients home.
    _, router = model_lib.abstract_state(trained, ctx)
    relayout = 2 * pipeline_cost.relayout_bytes(params, trained.param_logical, p, r, ctx)
    relayout += pipeline_cost.relayout_bytes(router, trained.router_logical, p, r, ctx)
    return pipeline_cost.pipeline_cost(config, dict(ctx.mesh.shape), hw, relayout)


def staged_choice(
    config: Config,
    ctx: Any,
    trained: Any,
    params: Any,
    hw: Hardware,
    note: str,
    grad_dtypes: GradientTraits,
) -> Choice:
    """auto with pipeline stages: deferred, the one policy that keeps one reduction per
    step (the pipeline loop is the accumulation loop; config/pipeline.py refuses the
    others), priced with the stages' compute, bubble and permutes
    (step/pipeline_cost.py) so its table shows what the stage axis costs."""
    deferred = dataclasses.replace(config.accumulation, gradient_reduction_policy="deferred")
    candidates = {"deferred": reduction_plan(config.parallelism, deferred, ctx, params)}
    pipe = stage_terms(config, ctx, trained, params, hw)
    costs = predict_all(
        config.model,
        config.parallelism,
        deferred,
        config.data,
        candidates,
        params,
        hw,
        grad_dtypes,
        step_flops=pipe.compute_seconds * hw.peak_flops,
    )
    costs = {policy: pipeline_cost.with_stages(c, pipe) for policy, c in costs.items()}
    note += "; pipeline stages: deferred (one reduction after the pipeline loop)"
    return Choice(("deferred",), costs, hw, note, pipeline=pipe)


def auto_order(
    costs: dict[str, cost_lib.Cost], candidates: dict[str, accum.ReductionPlan], ga: int
) -> tuple[str, ...]:
    """`rank`, with deferred first when one microbatch leaves nothing to accumulate."""
    order = rank(costs, any(p.slice_axes for p in candidates.values()))
    if ga == 1:
        order = ("deferred", *(p for p in order if p != "deferred"))
    return order


def next_choice(choice: Choice, reason: str) -> Choice:
    """`choice` without its first policy, which `reason` says does not fit.

    ConfigError naming what to change when nothing is left."""
    skipped = (*choice.skipped, f"{choice.policy}: {reason}")
    if len(choice.order) == 1:
        raise ConfigError(
            "gradient_reduction_policy=auto found no policy that fits in HBM ("
            + "; ".join(skipped)
            + "): lower per_device_batch_size or gradient_accumulation_steps, shard more "
            "(ici_fsdp_parallelism, shard_optimizer_over_data=true), or use a bigger chip"
        )
    return dataclasses.replace(choice, order=choice.order[1:], skipped=skipped)


def compile_first_fitting(
    run: Any,
    compile_run: Callable[[Any], Any],
    rebuild: Callable[[Choice], Any],
    hbm_bytes: int,
    memory_total: Callable[[Any], int],
) -> tuple[Any, Any]:
    """(run, compiled) of the first policy in `run.reduction_choice`'s order whose
    compiled step fits in `hbm_bytes` (XLA refusing with RESOURCE_EXHAUSTED counts as
    not fitting); each skipped policy is named in the choice's `skipped` lines. An
    explicit policy (no choice) is compiled once, as before. `rebuild(choice)` builds
    the run for the choice's first policy; ConfigError (next_choice) when none fits."""
    while True:
        try:
            compiled = compile_run(run)
        except Exception as error:  # only an out-of-memory refusal moves auto on
            if run.reduction_choice is None or "RESOURCE_EXHAUSTED" not in str(error):
                raise
            misfit = "XLA: " + str(error).strip().splitlines()[0][:120]
        else:
            total = memory_total(compiled)
            if run.reduction_choice is None or total <= hbm_bytes:
                return run, compiled
            misfit = f"compiled {total / GIB:.2f} GiB > {hbm_bytes / GIB:g} GiB HBM"
        run = rebuild(next_choice(run.reduction_choice, misfit))


def table_lines(choice: Choice, chosen: str | None = None) -> list[str]:
    """Policies x (wire bytes per chip on each link, exposed communication,
    accumulator, step time, DCN share of the step)."""
    chosen = chosen or choice.policy
    header = (
        f"  {'policy':15s} {'ICI MiB/step':>12s} {'DCN MiB/step':>12s} {'exposed ms':>10s} "
        f"{'accum GiB':>9s} {'step ms':>8s} {'DCN share':>9s}"
    )
    lines = [header]
    for policy in (*choice.order, *[s.split(":")[0] for s in choice.skipped]):
        c = choice.costs.get(policy)
        if c is None:
            continue
        ici, dcn = c.link_bytes[cost_lib.ICI], c.link_bytes[cost_lib.DCN]
        mark = "  <- chosen" if policy == chosen else ""
        lines.append(
            f"  {policy:15s} {ici / 2**20:12.2f} {dcn / 2**20:12.2f} "
            f"{c.exposed_seconds * 1e3:10.2f} {c.accumulator_bytes / GIB:9.3f} "
            f"{c.step_seconds * 1e3:8.2f} {c.dcn_share * 100:8.1f}%{mark}"
        )
    return lines


# What the table's MiB/step count, beside the collective summary's operand bytes
# (docs/cost_model.md, "The time model": r (g - 1) / g x operand per ring collective).
WIRE_BYTES_LINE = (
    "  MiB/step: bytes each chip sends, (g-1)/g x operand (x2 for an all-reduce); "
    "the collective summary counts operand bytes"
)


def margin_line() -> str:
    """The rule that keeps deferred chosen on a near tie (`rank`)."""
    return (
        "  a policy other than deferred is chosen only when predicted faster by more than "
        f"{DEFERRED_MARGIN:.0%}"
    )


def startup_lines(choice: Choice) -> list[str]:
    """What the trainer prints about the auto choice: the policy and why, the table of
    predictions, the margin rule that chose among them and what the bytes count. In
    shard_mode=auto no policy applies (XLA places every reduction), and the line says
    so rather than naming one."""
    if not choice.applies:
        head = f"gradient_reduction_policy=auto: no policy applies ({choice.note})"
        return [head, *pipeline_cost.lines(choice.pipeline)]
    head = f"gradient_reduction_policy=auto -> {choice.policy} ({choice.note})"
    lines = [head, *(f"  skipped {s}" for s in choice.skipped)]
    if choice.costs:
        lines.append("  predicted per device per step (accum.cost; docs/cost_model.md):")
        lines += table_lines(choice)
        if "deferred" in choice.costs and len(choice.costs) > 1:
            lines.append(margin_line())
        lines.append(WIRE_BYTES_LINE)
    return lines + pipeline_cost.lines(choice.pipeline)
