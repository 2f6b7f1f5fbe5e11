"""What the train binary prints before training: mesh, sizes, collectives of the step."""

from __future__ import annotations

import jax

import accum
import hlo_tools
import moe_kernels
from trainer.config import STAGE_AXIS, AccumulationConfig, DataConfig, ModelConfig, lora_targets
from trainer.config.moe_map import moe_config
from trainer.config.pipeline import (
    bubble_fraction,
    padded_layers,
    pipeline_microbatches,
    slots_per_chunk,
)
from trainer.model import flops
from trainer.run import xla_options

MIB = 1024 * 1024


def mesh_line(sizes: dict[str, int], mode: str) -> str:
    used = ", ".join(f"{axis}={size}" for axis, size in sizes.items() if size > 1) or "1 device"
    return f"mesh: {used} ({mode})"


def params_line(total: int, active: int, mtp: int = 0, depths: int = 0) -> str:
    """Parameter counts; with MTP on, its own share (in `total`) named separately."""
    line = f"params: {total / 1e6:.3f}M total, {active / 1e6:.3f}M active per token (matmuls)"
    if depths:
        line += (
            f"; multi-token prediction: {mtp / 1e6:.3f}M in {depths} "
            f"depth{'s' if depths > 1 else ''} ({mtp / max(total, 1) * 100:.2f}% of total; "
            "embedding and head shared)"
        )
    return line


def params_line_of(model: ModelConfig, params) -> str:
    """`params_line` for a run's parameters (arrays or ShapeDtypeStructs)."""
    return params_line(
        flops.count_params(params),
        flops.active_matmul_params(model),
        flops.mtp_param_count(params),
        model.mtp_num_layers,
    )


def lora_lines(model: ModelConfig, state: dict) -> list[str]:
    """With LoRA (a state holding a frozen base): what is trained and what is frozen."""
    if "frozen" not in state:
        return []

    trained, base = flops.count_params(state["params"]), flops.count_params(state["frozen"])
    dtypes = sorted({str(x.dtype) for x in jax.tree.leaves(state["frozen"])})
    rank, alpha = model.lora_rank, model.lora_alpha
    targets = ", ".join(sorted(lora_targets.resolve_targets(model)))
    return [
        f"lora: rank {rank}, alpha {alpha:g} (scale {alpha / rank:g}) on {targets}: "
        f"{trained:,} trained parameters (f32, {trained * 4 / MIB:.3f} MiB: the gradient "
        f"the step reduces), {trained / max(base, 1) * 100:.3f}% of the {base:,} frozen "
        f"ones ({'/'.join(dtypes)}): no gradient, optimizer state or gradient reduction "
        "for those"
    ]


def batch_line(accumulation: AccumulationConfig, data: DataConfig, global_batch: int) -> str:
    """Sequences and tokens per optimizer step, and how the microbatches split them.

    per_device_batch_size is per microbatch, as in MaxText: the global batch is
    per_device_batch_size x devices x gradient_accumulation_steps.
    """
    ga = accumulation.gradient_accumulation_steps
    tokens = global_batch * data.max_target_length
    return (
        f"batch: {global_batch} sequences x {data.max_target_length} tokens = {tokens:,} "
        f"tokens per step ({ga} microbatch{'es' if ga > 1 else ''} of {global_batch // ga}; "
        f"per_device_batch_size={data.per_device_batch_size:g} per microbatch)"
    )


def pipeline_lines(config, sizes: dict[str, int]) -> list[str]:
    """With pipeline stages: the schedule and its bubble, (p-1) / (m x repeats + p-1),
    the share of stage-iterations that hold no microbatch (model/pipeline.py)."""
    p = sizes.get(STAGE_AXIS, 1)
    if p == 1:
        return []
    m = pipeline_microbatches(config.parallelism, config.accumulation)
    r = config.num_pipeline_repeats
    bubble = bubble_fraction(p, m, r)
    schedule = "GPipe" if r == 1 else f"circular, {r} repeats"
    layers = config.num_moe_layers
    c, padded = slots_per_chunk(layers, p, r), padded_layers(layers, p, r)
    # Uneven stages: the padding slots, one at the end of each of the last chunks.
    uneven = (
        f" (uneven: {layers} MoE layers in {padded} slots, {padded - layers} padding = "
        f"{(padded - layers) / padded:.1%}, the last slot of the last {padded - layers} chunks)"
        if padded != layers
        else ""
    )
    return [
        f"pipeline: {p} stages x {c} MoE layer slots per chunk{uneven} "
        f"({schedule}), {m} microbatches, {m * r + p - 1} iterations: bubble "
        f"(p-1)/(m x repeats+p-1) = {p - 1}/{m * r + p - 1} = {bubble:.1%}; embedding, "
        "dense layers, output layer and MTP run on every stage",
        "  stage axis in the reduction plan: no gradient is reduced over 'stage' (the MoE "
        "layers' gradients are sharded over it, each stage's reduced over the batch axes "
        "after the pipeline loop; the other parameters' are computed alike on every stage)",
    ]


def plan_lines(accumulation: AccumulationConfig, plan: accum.ReductionPlan) -> list[str]:
    """The 'gradient reduction:' line from the plan, and with print_reduction_plan=true
    its table (parameter group x batch axis -> when)."""
    lines = [f"gradient reduction: {plan.summary()}"]
    if accumulation.print_reduction_plan:
        lines.append(f"reduction plan ({plan.policy}; '{accum.PER_USE}' = inside the model):")
        lines += [f"  {row}" for row in plan.table()]
    return lines


def collective_summary(
    text: str,
    accumulation: AccumulationConfig,
    mesh_shape: dict[str, int] | None = None,
    strict_axes: tuple[str, ...] = (),
    slice_axes: tuple[str, ...] = (),
    slice_of: list[int] | None = None,
    shard_mode: str = "explicit",
) -> list[str]:
    """Gradient reductions inside vs outside the loops, and bytes per step by kind
    (operand bytes, as hlo_tools counts them: the reduction table's MiB/step are the
    bytes a chip sends, (g-1)/g x these, twice that for an all-reduce).

    `strict_axes` (with `mesh_shape`): the axes no in-loop reduction may span
    (the plan's `strict_axes`). In-loop reductions over other axes only
    (FSDP's reduce-scatters, hierarchical's in-slice ones) are reported as
    expected, not as a failure. With `slice_axes` (the cross-slice mesh axes,
    outermost, or `slice_of`: each device's slice in the mesh's order, where the expert
    axis crosses slices), bytes per step are also split into cross-slice and in-slice. In
    `shard_mode=auto` the head names the mode instead of a reduction policy: XLA
    places every reduction there, whatever the policy key says.
    """
    module = hlo_tools.parse(text)
    inside = hlo_tools.in_loop_reductions(module)
    outside = hlo_tools.gradient_reductions_outside(module)
    flows = hlo_tools.traffic(module)
    lines = []
    for where in ("in_loop", "outside"):
        for kind, row in sorted(flows[where].items()):
            lines.append(
                f"  {where:8s} {kind:18s} {row['count']:4d} ops  "
                f"{row['bytes_per_step'] / MIB:10.3f} MiB/step"
            )
    if mesh_shape and slice_axes:
        lines.append(slice_split_line(module, mesh_shape, slice_axes, slice_of))
    outside_mib = sum(c.bytes for c in outside) / MIB
    overlapped = hlo_tools.overlapped_reductions(module)
    during = ""
    if overlapped:
        # An overlapped gradient_accumulation_schedule: the stacked layers' one reduction runs layer
        # by layer inside the last microbatch's backward scan.
        mib = sum(c.bytes_per_step or c.bytes for c in overlapped) / MIB
        during = f", {mib:.3f} MiB/step layer by layer in the last microbatch's backward"
    head = (
        f"collectives per step (GA={accumulation.gradient_accumulation_steps}, "
        f"{_policy_label(accumulation, shard_mode)}): "
        f"{len(outside)} gradient reductions after the loops ({outside_mib:.3f} MiB{during}); "
        + _verdict(text, module, inside, mesh_shape, strict_axes)
    )
    return [head, *lines]


def _policy_label(accumulation: AccumulationConfig, shard_mode: str) -> str:
    """What placed the reductions: the policy, or XLA in auto mode."""
    if shard_mode != "explicit":
        return f"shard_mode={shard_mode}: reductions placed by XLA"
    return f"gradient_reduction_policy={accumulation.gradient_reduction_policy}"


def slice_split_line(
    module,
    mesh_shape: dict[str, int],
    slice_axes: tuple[str, ...],
    slice_of: list[int] | None = None,
) -> str:
    """Collective bytes per step that cross slices vs stay inside one, in / after the
    loops; `slice_of` (each device's slice) where a slice is no block of the mesh."""
    import math

    if slice_of is not None:
        split = hlo_tools.slice_traffic(module, len(set(slice_of)), len(slice_of), slice_of)
        return "  " + hlo_tools.format_slice_traffic(split)
    if "expert" in slice_axes:
        # hlo_tools takes a slice for a contiguous block of the mesh's device order: true
        # of the outer dcn_ axes, not of the (inner) expert axis' cross-slice part.
        return "  cross-slice / in-slice split not given: the expert axis crosses slices"
    split = hlo_tools.slice_traffic(module, math.prod(mesh_shape[a] for a in slice_axes))
    return "  " + hlo_tools.format_slice_traffic(split)


def _activations(text: str, module, inside: list, mesh_shape: dict, strict_axes: tuple) -> list:
    """The in-loop reductions over a strict axis that accum's verdict does not
    take for a gradient's (context parallelism's keys' and values' cotangents);
    none when no loop is marked (nothing deferred: the verdict judged nothing)."""
    if accum.verdict.LOOP_SCOPE not in text:
        return []
    found = accum.in_loop_reductions(text, module)
    gradients = {(f.collective.computation, f.collective.name) for f in found}
    return [
        c
        for c in inside
        if (c.computation, c.name) not in gradients
        and any(hlo_tools.spans_mesh_axis(c, mesh_shape, a) for a in strict_axes)
    ]


def _verdict(text, module, inside, mesh_shape, strict_axes) -> str:
    if not inside:
        return "OK: every gradient reduced once per step"
    if mesh_shape and strict_axes:
        # hlo_tools judges by the replica groups: FAIL only for reductions
        # across an axis whose deferral covers every parameter, and only for those
        # accum's compiled verdict (the one the step was checked with) takes for a
        # gradient's: the others carry activations (context parallelism's keys and
        # values) by construction.
        return hlo_tools.verdict(
            module,
            mesh_shape=mesh_shape,
            over=strict_axes,
            activations=_activations(text, module, inside, mesh_shape, strict_axes),
        )["message"]
    mib = sum(c.bytes_per_step or c.bytes for c in inside) / MIB
    over = f" over {', '.join(hlo_tools.spanned_axes(inside, mesh_shape))}" if mesh_shape else ""
    return f"{len(inside)} gradient-sized reductions per loop iteration{over} ({mib:.3f} MiB/step)"


def capacity_lines(config, ctx, global_batch: int) -> list[str]:
    """What capacity_factor means on this mesh, for one microbatch (moe_kernels'
    `capacity_plan`): printed with a cap, or when expert parallelism pads its
    all-to-all blocks; nothing for a model without MoE layers."""
    model = config.model
    if not model.num_moe_layers:
        return []
    rows = global_batch // config.accumulation.gradient_accumulation_steps
    mesh, rules = ctx.mesh, ctx.rules
    if ctx.manual:  # inside the caller's shard_map: the layer sees one device's rows
        rows, mesh, rules = max(1, rows // ctx.mesh.size), None, None
    shape = (rows, config.data.max_target_length, model.emb_dim)
    plan = moe_kernels.capacity_plan(
        moe_config(model), shape, mesh, rules, sparse=model.sparse_matmul
    )
    if not model.capacity_factor and plan.path != "all_to_all":
        return []
    return [plan.describe()]


def grouped_matmul_lines(config, ctx) -> list[str]:
    """Which grouped matmul the routed experts compile to on the mesh's GPUs, and why
    (moe_kernels' choice: grouped_gemm needs a Hopper GPU and bf16 tiles); nothing
    for a model without sparse MoE layers, or off GPUs where auto is ragged_dot."""
    model = config.model
    if not model.num_moe_layers or not model.sparse_matmul:
        return []
    device = ctx.mesh.devices.flat[0]
    if device.platform != "gpu" and model.grouped_matmul == "auto":
        return []
    dims = (model.emb_dim, model.base_moe_mlp_dim)
    impl, why = moe_kernels.choose_grouped_matmul(model.grouped_matmul, device, model.dtype, dims)
    return [f"moe grouped matmul: {impl} ({why})"]


def gemm_lines(config, ctx) -> list[str]:
    """On GPUs, what the dense matmuls compile to: read from the compile options
    xla_options decides from gpu_gemm; nothing elsewhere."""
    if xla_options.platform_of(ctx.mesh) != "gpu":
        return []
    options = xla_options.for_mesh(config.parallelism, ctx.mesh)
    if not options.get("xla_gpu_enable_triton_gemm", True):
        return ["gemms: cuBLAS calls, adds of a product's shape folded in as C (gpu_gemm=cublas)"]
    return ["gemms: XLA's Triton GEMM fusions (gpu_gemm=triton)"]


def checkpoints_off_line(config) -> str:
    """The startup line of a run that saves no checkpoint (checkpoint_files.checkpoint_dir
    is None), naming the key that turned them off and what would turn them on."""
    directory = config.base_output_directory
    if config.enable_checkpointing:  # so base_output_directory is unset
        return "checkpoints: off (set base_output_directory=DIR to save and resume)"
    if directory:
        return (
            "checkpoints: off (enable_checkpointing=false: set it to true to save and "
            f"resume under {directory})"
        )
    return (
        "checkpoints: off (enable_checkpointing=false and no base_output_directory: set "
        "both to save and resume)"
    )
