"""moe_kernels: DeepSeek routing and grouped expert matmuls that keep their sharding tags."""

from moe_kernels.activation import gated_silu
from moe_kernels.capacity import CapacityPlan, capacity_plan
from moe_kernels.config import (
    DEFAULT_PARAM_AXES,
    DEFAULT_RULES,
    MoEConfig,
    fitting_expert_counts,
)
from moe_kernels.grouped import choose as choose_grouped_matmul
from moe_kernels.layer import dense_moe, sparse_moe
from moe_kernels.lora import LORA_TARGETS
from moe_kernels.module import MoE, RoutingBias
from moe_kernels.params import init_params, param_shapes, param_specs
from moe_kernels.routing import route, update_routing_bias
from moe_kernels.shard_plan import ManualExperts

__version__ = "0.1.0"

__all__ = [
    "CapacityPlan",
    "DEFAULT_PARAM_AXES",
    "DEFAULT_RULES",
    "LORA_TARGETS",
    "ManualExperts",
    "MoE",
    "MoEConfig",
    "RoutingBias",
    "capacity_plan",
    "choose_grouped_matmul",
    "dense_moe",
    "fitting_expert_counts",
    "gated_silu",
    "init_params",
    "param_shapes",
    "param_specs",
    "route",
    "sparse_moe",
    "update_routing_bias",
]
