"""What the train binary prints before training: mesh, sizes, collectives of the step."""

from __future__ import annotations

import hlo_tools
from trainer.config import Config

MIB = 1024 * 1024


def mesh_line(sizes: dict[str, int], mode: str) -> str:
    used = ", ".join(f"{axis}={size}" for axis, size in sizes.items() if size > 1) or "1 device"
    return f"mesh: {used} ({mode})"


def params_line(total: int, active: int) -> str:
    return f"params: {total / 1e6:.3f}M total, {active / 1e6:.3f}M active per token (matmuls)"


def deferral_line(config: Config, axes: tuple[str, ...]) -> str:
    """Whether gradient reductions are deferred to once per step, and over which axes."""
    if config.shard_mode != "explicit":
        return "gradient reduction: placed by XLA (auto mode carries no reduced/unreduced tags)"
    if not config.defer_gradient_reduction:
        return "gradient reduction: per microbatch (defer_gradient_reduction=false)"
    if not axes:
        return "gradient reduction: nothing to defer (no mesh axis shards the tokens)"
    return f"gradient reduction: deferred to once per step over {axes} (grads stay unreduced)"


def collective_summary(
    text: str,
    config: Config,
    mesh_shape: dict[str, int] | None = None,
    strict_axes: tuple[str, ...] = (),
) -> list[str]:
    """Gradient reductions inside vs outside the loops, and bytes per step by kind.

    `strict_axes` (with `mesh_shape`): the axes no in-loop reduction may span
    (`sharding.fully_deferred_axes`). In-loop reductions over other axes only
    (FSDP's reduce-scatters, say) are reported as expected, not as a failure.
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
    outside_mib = sum(c.bytes for c in outside) / MIB
    head = (
        f"collectives per step (GA={config.gradient_accumulation_steps}, "
        f"defer_gradient_reduction={str(config.defer_gradient_reduction).lower()}): "
        f"{len(outside)} gradient reductions after the loops ({outside_mib:.3f} MiB); "
        + _verdict(inside, mesh_shape, strict_axes)
    )
    return [head, *lines]


def _mib_per_step(records) -> float:
    return sum(c.bytes_per_step or c.bytes for c in records) / MIB


def _verdict(inside, mesh_shape, strict_axes) -> str:
    if not inside:
        return "OK: every gradient reduced once per step"
    if not mesh_shape:
        mib = _mib_per_step(inside)
        return f"{len(inside)} gradient-sized reductions run inside loops ({mib:.3f} MiB/step)"
    bad = [
        c for c in inside if any(hlo_tools.spans_mesh_axis(c, mesh_shape, a) for a in strict_axes)
    ]
    if bad:
        return (
            f"FAIL: {len(bad)} gradient-sized reductions over {', '.join(strict_axes)} run inside "
            f"loops ({_mib_per_step(bad):.3f} MiB/step): deferral is lost somewhere"
        )
    spanned = sorted(
        {a for c in inside for a in mesh_shape if hlo_tools.spans_mesh_axis(c, mesh_shape, a)},
        key=list(mesh_shape).index,
    )
    none_over = f"none over {', '.join(strict_axes)}; " if strict_axes else ""
    return (
        f"{none_over}{len(inside)} gradient-sized reductions per loop iteration over "
        f"{', '.join(spanned)} ({_mib_per_step(inside):.3f} MiB/step)"
    )
