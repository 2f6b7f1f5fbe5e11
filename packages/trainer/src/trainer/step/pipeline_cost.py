"""What pipeline stages add to a step's predicted cost: the bubble, the layers run on
every stage, and the permutes that move microbatches between stages.

The reduction cost model (accum.cost) prices the gradient reductions of a plan over
the batch axes; it knows nothing of the 'stage' axis, which reduces no gradient
(model/pipeline.py). With stages, `gradient_reduction_policy=auto` and
`plan-reduction` price deferred (the one policy that composes) with these terms
added (`with_stages`):

- compute: each stage chip runs its r chunks of c slots (1/p of the MoE layers,
  uneven stages' padding slots included: they compute too, their output thrown
  away) over its batch shard's tokens (p x a stage-less chip's, as 'stage' is not a
  batch axis) for (m x r + p - 1) / (m x r) of the time the work alone would take
  (the bubble), and the embedding, dense layers, output layer and MTP over all
  those tokens;
- collective-permutes over 'stage', counted as hlo_tools counts operand bytes:
  per pipeline iteration (m x r + p - 1 of them) the microbatch's activations
  and its positions and segments (int32) forward, the activations' cotangent
  backward; after the loop one more hop each way; with circular stages
  (r > 1) each stage's chunks brought to it once per step and their gradients
  sent home ((p - 1) rounds of ceil(r / p) chunks, trained leaves);
- the stage outputs handed to every stage: one activation-sized all-reduce over
  'stage' per step.

Every permute waits on the iteration before it, so none hides under compute: the
permutes' wire time is exposed. A permute talks to one neighbour, on ICI, or on
DCN where the stages span slices (dcn_pipeline_parallelism > 1: every hop waits
for the slowest, the one crossing slices). The per-chip ICI figure counts all of
a chip's links together, so this is optimistic for a permute's one link.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import numpy as np

import pspec_tags as pt
from accum import cost as cost_lib
from accum.hardware import Hardware
from trainer.config import Config
from trainer.config.pipeline import (
    bubble_fraction,
    padded_layers,
    pipeline_microbatches,
    stage_count,
)
from trainer.config.validate import batch_shard_count
from trainer.model import flops, stage_weights
from trainer.sharding import ShardCtx

POSITION_BYTES = 4  # positions and segments travel beside the activations as int32


@dataclasses.dataclass(frozen=True)
class PipelineCost:
    """Per device per optimizer step, what the stages add (module docstring)."""

    stages: int
    microbatches: int
    repeats: int
    bubble: float
    compute_seconds: float  # the whole step's compute with stages
    unstaged_compute_seconds: float  # the same batch on the same chips with no stages
    permute_bytes_in_loop: int  # collective-permute operand bytes inside the pipeline loop
    permute_bytes_outside: int  # ... outside it (the last hop, the circular relayout)
    stage_reduce_bytes: int  # the outputs' all-reduce over 'stage'
    link: str  # cost_lib.ICI or cost_lib.DCN: where the stage hops run
    link_bytes: float  # bytes each chip puts on that link
    wire_seconds: float  # their time, all exposed


def tokens_per_hop(config: Config, sizes: dict[str, int]) -> int:
    """Tokens one device sends per pipeline hop: its batch shard's share of one
    pipeline microbatch, times its share of the sequence."""
    devices = math.prod(sizes.values())
    sequences = config.per_device_batch_size * devices * config.gradient_accumulation_steps
    m = pipeline_microbatches(config.parallelism, config.accumulation)
    shards = batch_shard_count(config.parallelism, sizes)
    length_shards = sizes.get("context", 1)
    if config.expert_shard_attention_option == "context":
        length_shards *= sizes.get("expert", 1)
    rows = int(sequences) // (shards * m)
    return rows * (config.max_target_length // length_shards)


def relayout_bytes(leaves: Any, logical: Any, stages: int, repeats: int, ctx: ShardCtx) -> int:
    """Bytes a device's circular stages move one way per step for the leaves of
    `leaves` (arrays or ShapeDtypeStructs, with their `logical` axes) stacked in the
    pipelined stack ('stage_layers' first): (p - 1) rounds of ceil(r / p) chunks of c
    slots (the padded stack's rows / (p x r): uneven stages' padding travels too),
    each its device's part of the chunk: split over the leaf's other mesh axes (the
    experts' 'expert', attention's 'tensor'), whole over FSDP's and, in the MoE block,
    'tensor', which the stage gathers before the relayout (model/pipeline.py). 0 for
    GPipe (r = 1)."""
    if repeats == 1:
        return 0
    width = -(-repeats // stages)
    mesh = dict(ctx.mesh.shape)
    axes_of = jax.tree.leaves(logical, is_leaf=lambda x: isinstance(x, tuple))
    total = 0
    for (path, x), axes in zip(jax.tree_util.tree_leaves_with_path(leaves), axes_of, strict=True):
        if axes[:1] != ("stage_layers",):
            continue
        # Gathered before the relayout: FSDP's axes, and 'tensor' for the sub-modules
        # that run whole over it (the MoE block).
        gathered = (
            *stage_weights.FSDP_AXES,
            *((stage_weights.TENSOR_AXIS,) if stage_weights.whole_over_tensor_leaf(path) else ()),
        )
        # Dim 0 is the stack's, split by stages x repeats below.
        entries = pt.partitions(ctx.spec(axes, x.shape))[1:]
        split = math.prod(mesh[a] for e in entries for a in pt.entry_axes(e) if a not in gathered)
        chunk = math.prod(x.shape) // (stages * repeats * split) * np.dtype(x.dtype).itemsize
        total += (stages - 1) * width * chunk
    return total


def pipeline_cost(
    config: Config, sizes: dict[str, int], hw: Hardware, relayout: int = 0
) -> PipelineCost | None:
    """The stages' terms for `config` on mesh `sizes` priced with `hw`'s figures (None
    without stages); `relayout`: circular stages' bytes both ways (`relayout_bytes`
    of every stacked leaf forward, of the trained ones back)."""
    p = stage_count(config)
    if p == 1:
        return None
    m = pipeline_microbatches(config.parallelism, config.accumulation)
    r = config.num_pipeline_repeats
    iterations = m * r + p - 1
    tokens = tokens_per_hop(config, sizes)
    activation_bytes = tokens * config.emb_dim * np.dtype(config.dtype).itemsize
    forward_hop = activation_bytes + 2 * tokens * POSITION_BYTES
    in_loop = iterations * (forward_hop + activation_bytes)
    outside = 2 * activation_bytes + relayout
    reduce_bytes = m * activation_bytes
    tokens_per_chip = (
        config.per_device_batch_size * config.max_target_length * config.gradient_accumulation_steps
    )
    whole = flops.training_flops_per_token(config.model, config.data)
    staged = flops.pipelined_flops_per_token(config.model, config.data)
    rest = whole - staged
    # Slot-time: uneven stages run their padding slots too (p x r x c slots for L layers).
    layers = config.num_moe_layers
    slots = padded_layers(layers, p, r) / layers
    compute = tokens_per_chip * (staged * slots * iterations / (m * r) + p * rest) / hw.peak_flops
    link = cost_lib.DCN if config.dcn_pipeline_parallelism > 1 else cost_lib.ICI
    bandwidth = hw.dcn_bytes_per_s if link == cost_lib.DCN else hw.ici_bytes_per_s
    # A ring all-reduce puts 2(p-1)/p of its operand on each chip's link.
    on_link = in_loop + outside + 2 * (p - 1) / p * reduce_bytes
    return PipelineCost(
        stages=p,
        microbatches=m,
        repeats=r,
        bubble=bubble_fraction(p, m, r),
        compute_seconds=compute,
        unstaged_compute_seconds=tokens_per_chip * whole / hw.peak_flops,
        permute_bytes_in_loop=in_loop,
        permute_bytes_outside=outside,
        stage_reduce_bytes=reduce_bytes,
        link=link,
        link_bytes=on_link,
        wire_seconds=on_link / bandwidth,
    )


def with_stages(cost: cost_lib.Cost, pipe: PipelineCost) -> cost_lib.Cost:
    """`cost` (a plan's, priced with the stages' compute) with the stage hops added to
    its link figures and, all exposed, to its step time."""
    link_bytes = dict(cost.link_bytes)
    link_seconds = dict(cost.link_seconds)
    link_bytes[pipe.link] += pipe.link_bytes
    link_seconds[pipe.link] += pipe.wire_seconds
    dcn = pipe.wire_seconds if pipe.link == cost_lib.DCN else 0.0
    return dataclasses.replace(
        cost,
        link_bytes=link_bytes,
        link_seconds=link_seconds,
        exposed_seconds=cost.exposed_seconds + pipe.wire_seconds,
        step_seconds=cost.step_seconds + pipe.wire_seconds,
        dcn_exposed_seconds=cost.dcn_exposed_seconds + dcn,
    )


def lines(pipe: PipelineCost | None) -> list[str]:
    """The startup/plan-reduction lines: the stages' predicted terms."""
    if pipe is None:
        return []
    link = "DCN" if pipe.link == cost_lib.DCN else "ICI"
    extra = pipe.compute_seconds - pipe.unstaged_compute_seconds
    return [
        f"  pipeline (predicted): compute {pipe.compute_seconds * 1e3:.2f} ms per step, "
        f"{extra * 1e3:+.2f} ms against no stages (bubble {pipe.bubble:.1%}, the layers "
        "outside the pipeline on every stage); stage permutes "
        f"{pipe.permute_bytes_in_loop / 2**20:.2f} MiB in the loop, "
        f"{pipe.permute_bytes_outside / 2**20:.2f} MiB outside, outputs all-reduced over "
        f"'stage' {pipe.stage_reduce_bytes / 2**20:.2f} MiB: {pipe.wire_seconds * 1e3:.2f} ms "
        f"on {link}, exposed",
    ]
