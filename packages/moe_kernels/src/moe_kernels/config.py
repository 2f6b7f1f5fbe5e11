"""MoE hyperparameters, their validation, and the logical axis names of every parameter."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from moe_kernels.grouped import IMPLS as GROUPED_IMPLS

# Logical axis names of every parameter, by parameter name. The trainer maps
# them to mesh axes with its logical rules (`pspec_tags.logical_to_spec`).
#   gate        (D, E)   router kernel; its expert dim stays replicated
#   bias        (E,)     aux-loss-free routing bias: selection only, no gradient
#   wi_0, wi_1  (E, D, F) SwiGLU input kernels of the routed experts
#   wo          (E, F, D) output kernel of the routed experts
#   shared_*             the always-on shared-expert MLP (D, Fs) / (Fs, D)
DEFAULT_PARAM_AXES: tuple[tuple[str, tuple[str | None, ...]], ...] = (
    ("gate", ("embed", None)),
    ("bias", (None,)),
    ("wi_0", ("exp", "embed", "mlp")),
    ("wi_1", ("exp", "embed", "mlp")),
    ("wo", ("exp", "mlp", "embed")),
    ("shared_wi_0", ("embed", "mlp")),
    ("shared_wi_1", ("embed", "mlp")),
    ("shared_wo", ("mlp", "embed")),
)

# A rule set that serves meshes with any subset of (data, fsdp, expert, tensor):
# tokens are sharded over every batch-like axis, experts over `expert`, the
# embedding dim of the weights over `fsdp` (gathered inside the shard_map).
DEFAULT_RULES: tuple[tuple[str, Any], ...] = (
    ("activation_batch", ("data", "fsdp", "expert")),
    ("activation_length", None),
    ("exp", "expert"),
    ("embed", "fsdp"),
    ("mlp", None),
)

SCORE_FUNCS = ("sigmoid", "softmax")
# How experts are chosen (DeepSeek's / Hugging Face's `topk_method`):
#   noaux_tc             DeepSeek-V3: a group scores the sum of its two best
#                        (bias-corrected) scores; top-k inside the best groups
#   group_limited_greedy DeepSeek-V2: a group scores its best expert's score
#   greedy               plain top-k over all experts (no groups)
TOPK_METHODS = ("noaux_tc", "group_limited_greedy", "greedy")


@dataclasses.dataclass(frozen=True)
class MoEConfig:
    """Hyperparameters of one MoE layer (DeepSeek-V3 defaults where they exist).

    num_experts, num_experts_per_tok: E routed experts, Z picked per token.
    n_groups, topk_groups: group-limited routing; experts split into `n_groups`
        equal groups, only the `topk_groups` best groups may be picked
        (1, 1 = no group limit).
    routed_scaling_factor: multiplies the (normalized) combine weights.
    score_func: 'sigmoid' (DeepSeek-V3) or 'softmax' (DeepSeek-V2, Mixtral).
    topk_method: 'noaux_tc' (DeepSeek-V3, default), 'group_limited_greedy'
        (DeepSeek-V2) or 'greedy' (plain top-k; needs n_groups=1): see TOPK_METHODS.
    norm_topk_prob: renormalize the Z combine weights to sum to one.
    mlp_dim: hidden size F of each routed expert.
    num_shared_experts, shared_mlp_dim: the always-on MLP; its hidden size is
        `shared_mlp_dim` (default `num_shared_experts * mlp_dim`); 0 experts = none.
    expert_axis: mesh axis that shards experts (expert parallelism).
    batch_axis, length_axis: logical names of the token dims in the rules.
    param_axes: logical axis names per parameter, a mapping or (name, axes)
        pairs (see DEFAULT_PARAM_AXES); stored as sorted pairs so the config
        stays hashable (usable as a jit static argument).
    capacity_factor: 0 (default) = no token is ever dropped (the all-to-all
        buffer holds every assignment), as MaxText's and the trainer's key; a
        positive float caps each (source, destination) block of the padded
        all-to-all at ceil(T*Z/EP * capacity_factor) rows and, on every other
        path (no expert parallelism, tokens not sharded over the expert axis,
        dense), each expert at ceil(T*Z/E * capacity_factor) of a shard's T*Z
        assignments; what overflows is dropped and counted (stats['dropped']).
        None, the earlier spelling of 0, is stored as 0.0.
    router_z_loss: also return each token's router z, logsumexp(logits)^2, as
        stats['router_z_BxS'] (for a z-loss; off: not computed at all).
    precision: matmul precision (`jax.lax.Precision` name or None).
    lora_scale: alpha / rank of LoRA adapters on the expert kernels: params
        `<kernel>_lora_a` / `<kernel>_lora_b` (layer.LORA_TARGETS) make each such
        kernel W + lora_scale x A @ B inside the layer (unused without them).
    grouped_matmul: how the sparse path runs the experts' grouped matmuls
        (grouped.IMPLS): 'ragged_dot', 'padded_blocks', 'grouped_gemm' (Hopper
        GPUs), or 'auto' (grouped_gemm on Hopper, padded_blocks on other GPUs,
        ragged_dot elsewhere; `grouped.choose`).

    Inconsistent values are refused when the config is built:

    >>> from moe_kernels import MoEConfig
    >>> MoEConfig(num_experts=4, num_experts_per_tok=2, n_groups=2, topk_groups=1).experts_per_group
    2
    >>> MoEConfig(num_experts=4, num_experts_per_tok=5)
    Traceback (most recent call last):
    ...
    ValueError: num_experts_per_tok (top_k)=5 must be between 1 and num_experts=4
    """

    num_experts: int = 8
    num_experts_per_tok: int = 2
    mlp_dim: int = 64
    n_groups: int = 1
    topk_groups: int = 1
    routed_scaling_factor: float = 1.0
    score_func: str = "sigmoid"
    topk_method: str = "noaux_tc"
    norm_topk_prob: bool = True
    num_shared_experts: int = 0
    shared_mlp_dim: int | None = None
    expert_axis: str = "expert"
    batch_axis: str = "activation_batch"
    length_axis: str = "activation_length"
    param_axes: Any = DEFAULT_PARAM_AXES
    capacity_factor: float = 0.0
    precision: str | None = "highest"
    grouped_matmul: str = "auto"
    router_z_loss: bool = False
    lora_scale: float = 1.0

    def __post_init__(self):
        axes = self.param_axes
        pairs = axes.items() if isinstance(axes, Mapping) else axes
        object.__setattr__(self, "param_axes", tuple(sorted((str(n), tuple(a)) for n, a in pairs)))
        e, k = self.num_experts, self.num_experts_per_tok
        if e < 1:
            raise ValueError(f"num_experts={e} must be at least 1")
        if not 1 <= k <= e:
            raise ValueError(
                f"num_experts_per_tok (top_k)={k} must be between 1 and num_experts={e}"
            )
        if self.n_groups < 1 or e % self.n_groups:
            raise ValueError(
                f"n_groups={self.n_groups} does not divide num_experts={e} into equal groups"
            )
        if not 1 <= self.topk_groups <= self.n_groups:
            raise ValueError(
                f"topk_groups={self.topk_groups} must be between 1 and n_groups={self.n_groups}"
            )
        allowed = self.topk_groups * (e // self.n_groups)
        if k > allowed:
            raise ValueError(
                f"num_experts_per_tok={k} exceeds the {allowed} experts in topk_groups="
                f"{self.topk_groups} groups of {e // self.n_groups}"
            )
        if self.score_func not in SCORE_FUNCS:
            raise ValueError(f"score_func={self.score_func!r} is not one of {SCORE_FUNCS}")
        if self.grouped_matmul not in GROUPED_IMPLS:
            raise ValueError(
                f"grouped_matmul={self.grouped_matmul!r} is not one of {GROUPED_IMPLS}"
            )
        if self.topk_method not in TOPK_METHODS:
            raise ValueError(f"topk_method={self.topk_method!r} is not one of {TOPK_METHODS}")
        if self.topk_method == "greedy" and self.n_groups != 1:
            raise ValueError(
                f"topk_method='greedy' picks over all experts: n_groups={self.n_groups} "
                "must be 1 (or use noaux_tc / group_limited_greedy)"
            )
        if self.mlp_dim < 1:
            raise ValueError(f"mlp_dim={self.mlp_dim} must be positive")
        if self.num_shared_experts < 0:
            raise ValueError(f"num_shared_experts={self.num_shared_experts} must be >= 0")
        if self.capacity_factor is None:
            # One meaning of 'no token dropped' (0), whichever spelling came in.
            object.__setattr__(self, "capacity_factor", 0.0)
        if self.capacity_factor < 0:
            raise ValueError(
                f"capacity_factor={self.capacity_factor} must be >= 0 (0 = no token dropped)"
            )
        missing = sorted(set(dict(DEFAULT_PARAM_AXES)) - set(self.logical_axes))
        if missing:
            raise ValueError(f"param_axes lacks logical axes for {missing}")

    @property
    def logical_axes(self) -> dict[str, tuple[str | None, ...]]:
        """Logical axis names by parameter name."""
        return dict(self.param_axes)

    @property
    def shared_dim(self) -> int:
        """Hidden size of the shared-expert MLP (0 when there is none)."""
        if self.num_shared_experts == 0:
            return 0
        return self.shared_mlp_dim or self.num_shared_experts * self.mlp_dim

    @property
    def experts_per_group(self) -> int:
        return self.num_experts // self.n_groups


def fitting_expert_counts(num_experts: int, multiple: int, count: int = 2) -> list[int]:
    """The `count` positive multiples of `multiple` nearest `num_experts`, ascending:
    the expert counts an expert axis of size `multiple` (times any group count
    folded into it) can shard evenly.

    >>> fitting_expert_counts(6, 8), fitting_expert_counts(12, 8), fitting_expert_counts(20, 8)
    ([8, 16], [8, 16], [16, 24])
    """
    below = num_experts // multiple * multiple
    candidates = {
        m for m in (below - multiple, below, below + multiple, below + 2 * multiple) if m > 0
    }
    nearest = sorted(candidates, key=lambda m: (abs(m - num_experts), m))[:count]
    return sorted(nearest)
