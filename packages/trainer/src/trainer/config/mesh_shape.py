"""Mesh axis sizes from the *_parallelism keys and the device count."""

from __future__ import annotations

import math

from trainer.config.keys import HYBRID_AXES, OTHER_DCN_KEYS, STAGE_AXIS, ConfigError
from trainer.config.run_keys import ParallelismConfig


def _fill(sizes: dict[str, int], total: int, prefix: str, what: str) -> dict[str, int]:
    """`sizes` with the (single) -1 entry filling `total`; ConfigError naming the keys."""
    key = lambda axis: f"{prefix}{axis.removeprefix('dcn_')}_parallelism"  # noqa: E731
    fill = [axis for axis, size in sizes.items() if size == -1]
    if len(fill) > 1:
        raise ConfigError(
            f"only one {prefix}*_parallelism may be -1; got -1 for "
            + ", ".join(key(a) for a in fill)
        )
    for axis, size in sizes.items():
        if size == 0 or size < -1:
            raise ConfigError(f"{key(axis)}={size} must be a positive size or -1")
    fixed = math.prod(size for size in sizes.values() if size != -1)
    if fill:
        if total % fixed:
            raise ConfigError(
                f"{key(fill[0])}=-1 cannot fill {total} {what}: the other "
                f"axes multiply to {fixed}, which does not divide {total}"
            )
        sizes[fill[0]] = total // fixed
    product = math.prod(sizes.values())
    if product != total:
        listing = ", ".join(f"{key(a)}={s}" for a, s in sizes.items() if s != 1)
        raise ConfigError(
            f"the {prefix}*_parallelism keys multiply to {product} ({listing or 'all 1'}) but "
            f"there are {total} {what}: change them so their product is {total}, or set "
            "one of them to -1 to fill the " + what
        )
    return sizes


def _check_other_dcn_keys(parallelism: ParallelismConfig) -> None:
    """ConfigError naming the first of OTHER_DCN_KEYS not left at 1."""
    for key in OTHER_DCN_KEYS:
        value = getattr(parallelism, key)
        if value != 1:
            raise ConfigError(
                f"{key}={value} is not supported: only dcn_data_parallelism, "
                "dcn_fsdp_parallelism, dcn_pipeline_parallelism and dcn_expert_parallelism "
                "cross slices here (cross-slice tensor or context parallelism would put "
                "per-layer collectives on DCN); set it to 1"
            )


def _filled(
    parallelism: ParallelismConfig, num_devices: int, num_slices: int
) -> tuple[dict[str, int], dict[str, int]]:
    """(dcn sizes filling `num_slices`, ici sizes filling one slice's devices), -1s filled."""
    _check_other_dcn_keys(parallelism)
    if num_slices < 1 or num_devices % num_slices:
        raise ConfigError(
            f"num_slices={num_slices} does not divide the {num_devices} devices into equal slices"
        )
    dcn = _fill(parallelism.dcn_parallelism(), num_slices, "dcn_", "slices")
    per_slice = "devices" if num_slices == 1 else "devices per slice"
    ici = _fill(parallelism.ici_parallelism(), num_devices // num_slices, "ici_", per_slice)
    return dcn, ici


def mesh_shape(
    parallelism: ParallelismConfig, num_devices: int, num_slices: int = 1
) -> dict[str, int]:
    """Mesh axis sizes (MESH_AXES order): the dcn_ axes fill `num_slices`, the ici_
    axes the devices of one slice; a -1 fills what the others leave. MaxText's other
    dcn_ keys (OTHER_DCN_KEYS) must be 1. (A whole Config is a ParallelismConfig too.)"""
    dcn, ici = _filled(parallelism, num_devices, num_slices)
    # One 'stage' axis and one 'expert' axis, each with its cross-slice part major
    # (slices.device_array lays it out).
    stage = dcn.pop("dcn_pipeline") * ici.pop("pipeline")
    ici["expert"] *= dcn.pop("dcn_expert")
    return {STAGE_AXIS: stage, **dcn, **ici}


def dcn_parts(
    parallelism: ParallelismConfig, num_devices: int, num_slices: int = 1
) -> dict[str, int]:
    """The cross-slice part of each HYBRID_AXES mesh axis ({'stage': dcn_pipeline,
    'expert': dcn_expert}, -1 filled): what slices.device_array spreads over the
    slices, the rest of the axis staying inside one."""
    dcn, _ = _filled(parallelism, num_devices, num_slices)
    return {axis: dcn[name] for name, axis in HYBRID_AXES.items()}


def expert_keys(parallelism: ParallelismConfig) -> str:
    """The keys that size the expert axis, as an error message names them."""
    if parallelism.dcn_expert_parallelism == 1:
        return "ici_expert_parallelism"
    return "dcn_expert_parallelism x ici_expert_parallelism"
