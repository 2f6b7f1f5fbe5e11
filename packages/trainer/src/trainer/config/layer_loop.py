"""`scan_layers=auto` decided: whether the decoder's layers run as one lax.scan.

The parameters are stacked on a layer axis either way (model/decoder.py), so this
chooses how XLA sees the layer loop, not what is trained or saved. Scanned, the
program holds one layer and compiles in a time independent of depth; each trip
saves its residuals into stacked buffers and slices its weights out of the stack,
a kernel for each. On a GPU every kernel is a launch, and deepseek3-small's
scanned step launches about twice the kernels of the unrolled one
(docs/performance.md, "Compiling for GPUs from a CPU host"). So auto unrolls on
GPUs and scans elsewhere, and scans wherever the accumulation schedule works inside
the backward layer scan (overlapped, overlapped_ring). On a TPU the scan is not
free either: on one v5e chip the unrolled step of deepseek3-small's 6- and 12-layer
cuts ran faster than the scanned one, in less compiled memory, and compiled in time
growing with depth where the scan's stays flat (the figures:
benchmarks/results/device_check_tpu_v5e.md). Auto keeps the scan there, for its
compile time and the fused schedule; `scan_layers=false` is the faster long run.
"""

from __future__ import annotations

import dataclasses

from trainer.config.config import Config

# The schedules that run inside the backward layer scan (validate refuses them unscanned).
SCAN_SCHEDULES = ("overlapped", "overlapped_ring")
# What JAX calls a CUDA or ROCm device (`device.platform`), as attention_kernel reads it.
GPU_PLATFORM = "gpu"


def scans_layers(config: Config, platforms: frozenset[str]) -> bool:
    """`config.scan_layers` for devices of `platforms` (empty: an AbstractMesh, no
    platform known, scanned): true or false as given; auto as the module says."""
    if config.scan_layers != "auto":
        return config.scan_layers
    if config.gradient_accumulation_schedule in SCAN_SCHEDULES:
        return True
    return platforms != {GPU_PLATFORM}


def decide_scan_layers(config: Config, devices: tuple) -> Config:
    """`config` with scan_layers true or false for `devices` (run.resolve, once)."""
    platforms = frozenset(device.platform for device in devices)
    return dataclasses.replace(config, scan_layers=scans_layers(config, platforms))
