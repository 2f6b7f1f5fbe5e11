"""The predicted GPU step time of a deviceless compile (`train compile_topology=h200-1`).

hlo_tools.gpu_estimate prices each kernel of the compiled program on a roofline
calibrated against a measured H200 profile; this module tells it what only the
trainer knows: the chip's figures (gpu_topology.CHIPS, flops.PEAK_TFLOPS), which
function is the model's XLA attention (a compile-only GPU has no cuDNN, so the
program holds `MLA._dot_product`, which the device runs as cuDNN's fused kernel),
the helpers a kernel's source line looks through to the model code that called
them, and the model's FLOPs per step for the MFU.
"""

from __future__ import annotations

from hlo_tools import gpu_estimate, gpu_kernels
from trainer.model import flops
from trainer.model.attention import MLA
from trainer.model.layers import MLP
from trainer.model.lora import project
from trainer.run import gpu_topology
from trainer.sharding import ShardCtx

# The model's XLA attention: its kernels are priced as cuDNN's (gpu_estimate.Roofline).
ATTENTION_FUNCTIONS = (MLA._dot_product.__qualname__,)
# Wrappers every projection goes through: a source line names their caller instead.
THROUGH = (
    ShardCtx.einsum.__qualname__,
    ShardCtx.act.__qualname__,
    project.__qualname__,
    MLA._project.__qualname__,
    MLP._project.__qualname__,
)
TOP = 5  # kernel groups the AOT report lists


def roofline(chip_name: str) -> gpu_estimate.Roofline:
    """The calibrated roofline for a gpu_topology.CHIPS chip."""
    chip = gpu_topology.CHIPS[chip_name]
    peak = next(v for k, v in flops.PEAK_TFLOPS.items() if chip.description.startswith(k))
    return gpu_estimate.Roofline(peak * 1e12, chip.memory_bandwidth)


def kernels_of_files(hlo_path: str, thunks_path: str | None = None) -> list[gpu_kernels.Kernel]:
    """The kernels of a compile `aot` wrote: its HLO, thunk sequence and metadata
    (x.hlo, x.thunks.txt, x.thunk_metadata.txt)."""
    thunks_path = thunks_path or hlo_path.removesuffix(".hlo") + ".thunks.txt"
    with open(hlo_path) as f:
        hlo = f.read()
    with open(thunks_path) as f, open(gpu_topology.metadata_path(thunks_path)) as g:
        sequence, metadata = f.read(), g.read()
    return gpu_kernels.launched_kernels(sequence, metadata, hlo, ATTENTION_FUNCTIONS, THROUGH)


def flops_per_step(config, batch_size: int) -> float:
    """The model's training FLOPs per step (trainer.model.flops), all devices."""
    per_token = flops.training_flops_per_token(config.model, config.data)
    return per_token * batch_size * config.max_target_length


def estimate(result) -> gpu_estimate.Estimate:
    """The estimate of an aot.AotResult compiled for a GPU topology."""
    return gpu_estimate.estimate_step(
        kernels_of_files(result.hlo_path), roofline(result.topology.chip)
    )


def mfu(est: gpu_estimate.Estimate, result) -> float:
    """Predicted MFU: the model's FLOPs per step per device over peak x predicted time."""
    devices = result.run.ctx.mesh.size
    per_device = flops_per_step(result.run.config, result.run.batch_size) / devices
    return per_device / (est.total_ms * 1e-3 * roofline(result.topology.chip).peak_flops)


def report_lines(result) -> list[str]:
    """The AOT report's estimate lines (hlo_tools.gpu_estimate.format_estimate)."""
    est = estimate(result)
    devices = result.run.ctx.mesh.size
    per_device = flops_per_step(result.run.config, result.run.batch_size) / devices
    return gpu_estimate.format_estimate(
        est, TOP, per_device, roofline(result.topology.chip).peak_flops
    )
