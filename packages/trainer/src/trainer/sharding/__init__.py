"""Meshes and how every array is laid out on them.

- ctx.py: `make_mesh`, `logical_rules` (logical axis -> mesh axes), and `ShardCtx`,
  the one object model code shards through; `reduction_plan` (accum's plan for the
  trained parameters).
- slices.py: multi-slice device order and the cross-slice axes.
- distributed.py: the multi-process launch (`jax.distributed`).
"""

from trainer.sharding.ctx import ShardCtx, logical_rules, make_mesh, reduction_plan

__all__ = ["ShardCtx", "logical_rules", "make_mesh", "reduction_plan"]
