"""A GPU step's time from its compiled program, without a GPU: a roofline per
launched kernel, with per-category factors fitted to a measured profile.

Each kernel (gpu_kernels.Kernel: bytes, matmul FLOPs, executions per step) costs,
per execution,

    launch + slowdown[category] x max(bytes / (HBM bandwidth x hbm_efficiency),
                                      flops / (peak x matmul_efficiency(flops)))

where matmul_efficiency falls as sqrt(flops / matmul_full_flops) below that size
(a small GEMM fills few of the SMs). "attention" kernels (the model's XLA
attention, which a GPU with cuDNN runs as fused kernels; or cuDNN's own custom
calls, in a program compiled with cuDNN) cost their matmul FLOPs at
`attention_efficiency` of peak, and nothing for the XLA attention's softmax and
masking (fused into cuDNN's kernel).

A conditional (``lax.cond``, ``lax.switch``) runs one branch per execution, and
which one is data: it is priced as its costliest branch (an upper bound).

What it cannot see: GEMM autotuning (a compile-only GPU compiles XLA's default
Triton tiles, or cuBLAS calls with their default algorithm where Triton GEMMs are
off; the device may pick other tiles or algorithms), cuDNN's internals (its
attention cost is one calibrated rate), caches (every byte is an HBM byte), and
overlap between streams (kernels run one after another, as a single-GPU step
without collectives does).

CALIBRATION is the one table of efficiencies every caller reads; `fit_calibration` refits
it from a device profile's per-group milliseconds (what benchmarks/device_check.py
writes on a lent GPU).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

from hlo_tools.gpu_kernels import CATEGORIES, PROFILE_GROUP, Kernel
from hlo_tools.thunks import conditionals, pick_branches


@dataclass(frozen=True)
class Calibration:
    """Dimensionless efficiencies of a roofline (see the module docstring)."""

    hbm_efficiency: float
    matmul_efficiency: float
    matmul_full_flops: float  # a GEMM of at least this many FLOPs reaches matmul_efficiency
    attention_efficiency: float  # cuDNN attention's matmul FLOPs, share of peak
    launch_s: float  # per kernel launch
    slowdown: dict[str, float] = field(default_factory=dict)  # category -> factor (1 if absent)
    source: str = ""  # where the numbers came from


# The calibration every caller reads. Where each number comes from:
# - hbm_efficiency 0.75: streaming kernels reach about 75% of the HBM datasheet figure
#   (4.8 TB/s on an H200) on Hopper;
# - matmul_efficiency 0.70 at 20 GFLOP and above: a well-tiled bf16 GEMM reaches
#   650-750 of 989 TFLOP/s; smaller ones fill fewer SMs (sqrt fall-off, a guess);
# - launch_s 2 us: the gap between back-to-back kernels on one stream;
# - attention_efficiency and slowdown: `fit_calibration` to the 2026-12-04 H200 profile
#   (benchmarks/results/device_check.md: deepseek3-small, per_device_batch_size=8,
#   GA=4, scan_layers=true) over this tree's deviceless compile of the same shape
#   (benchmarks/bench_gpu_estimate.py --only calibration --refit prints the fit; its page,
#   benchmarks/results/gpu_estimate.md, compares each group). Readings: XLA's
#   scatters (and sorts: one profile group) run about 40x slower than their bytes
#   (atomic read-modify-writes), transposes were too few on the device to fit (held
#   at the 0.25 bound), elementwise and "other" kernels about 1.8x (small, latency-
#   bound). The calibration program has no gather kernel: gather is not fitted
#   (FIT_KEEPS) and is priced as a small elementwise kernel (1.842), a prior.
#   attention_efficiency is the measured attention time over the FLOPs the device's
#   cuDNN calls ran (the same shape compiled with cuDNN on this host, `--cudnn`, kept
#   beside the row: `fit_calibration(device_attention=...)`), not over the stand-in's
#   XLA attention: that call zero-padded v from 64 to q's 96, the stand-in does not
#   (over its FLOPs the rate read 0.2115). Today's call takes v at 64
#   (model/cudnn_attention.py); its rate per FLOP is assumed the padded call's.
CALIBRATION = Calibration(
    hbm_efficiency=0.75,
    matmul_efficiency=0.70,
    matmul_full_flops=20e9,
    attention_efficiency=0.2505,
    launch_s=2e-6,
    slowdown={
        "matmul": 0.794,
        "copy": 0.889,
        "dynamic-update-slice": 0.97,
        "broadcast": 0.878,
        "reduce": 0.783,
        "convert": 0.912,
        "transpose": 0.25,
        "select": 2.344,
        "scatter": 40.402,
        "sort": 40.402,
        "gather": 1.842,
        "slice/pad": 1.842,
        "elementwise": 1.842,
        "other": 1.842,
    },
    source="fit to the 2026-12-04 H200 profile (device_check.md), deepseek3-small pdbs 8 GA 4 "
    "scan_layers=true",
)


# Datasheet figures of the chips the calibration was made for (dense bf16 FLOP/s, HBM
# bytes/s; NVIDIA H100/H200 SXM), for callers that know no chip table of their own
# (hlo-report --gpu; the trainer reads its gpu_topology.CHIPS, the same figures).
CHIPS = {"h100": (989e12, 3.35e12), "h200": (989e12, 4.8e12)}

# Categories `fit_calibration` leaves alone though their profile group is refit: a
# concatenate is a plain copy kernel and a gather a plain indexed read, while their
# group's measured time (scatter/sort/gather) went to XLA's scatters (and sorts).
FIT_KEEPS = frozenset({"concatenate", "gather"})


@dataclass(frozen=True)
class Roofline:
    """One chip's figures and the calibration pricing kernels on it."""

    peak_flops: float  # dense bf16 FLOP/s
    hbm_bandwidth: float  # bytes/s
    calibration: Calibration = CALIBRATION

    def kernel_s(self, kernel: Kernel) -> float:
        """Seconds of one execution of `kernel` (module docstring)."""
        c = self.calibration
        if kernel.category == "attention":
            # cuDNN fuses the softmax and mask into its matmul kernels: only they launch.
            if not kernel.flops:
                return 0.0
            return c.launch_s + kernel.flops / (self.peak_flops * c.attention_efficiency)
        return c.launch_s + c.slowdown.get(kernel.category, 1.0) * self.roof_s(kernel)

    def roof_s(self, kernel: Kernel) -> float:
        """The kernel's roofline seconds before its category's slowdown and launch."""
        c = self.calibration
        memory = kernel.bytes / (self.hbm_bandwidth * c.hbm_efficiency)
        if not kernel.flops:
            return memory
        share = min(1.0, math.sqrt(kernel.flops / c.matmul_full_flops))
        return max(memory, kernel.flops / (self.peak_flops * c.matmul_efficiency * share))


@dataclass(frozen=True)
class Group:
    """Kernels sharing a source line: their per-step launches, bytes, FLOPs, ms."""

    source: str
    launches: int
    bytes: int
    flops: int
    ms: float
    categories: tuple[str, ...]


@dataclass
class Estimate:
    """A step's predicted time: ``ms[i]`` is kernel ``kernels[i]``'s ms per step
    (all its executions); ``by_category`` maps each category to (launches per
    step, bytes per step, ms per step); ``groups`` by source line, costliest first;
    ``conditionals``: how many conditionals were priced by one branch, the
    ``branch`` one ("costliest" or "cheapest")."""

    kernels: list[Kernel]
    ms: list[float]
    by_category: dict[str, tuple[int, int, float]]
    groups: list[Group]
    conditionals: int = 0
    branch: str = "costliest"

    @property
    def total_ms(self) -> float:
        """Predicted milliseconds per step."""
        return sum(self.ms)

    @property
    def launches(self) -> int:
        """Kernels launched per step (attention's softmax/mask kernels included)."""
        return sum(k.executions for k in self.kernels)

    @property
    def flops(self) -> int:
        """Matmul FLOPs per step, attention's included."""
        return sum(k.flops * k.executions for k in self.kernels)

    def by_group(self) -> dict[str, float]:
        """ms per step by the device profile's groups (PROFILE_GROUP)."""
        out: dict[str, float] = {}
        for cat, (_, _, ms) in self.by_category.items():
            out[PROFILE_GROUP[cat]] = out.get(PROFILE_GROUP[cat], 0.0) + ms
        return out


def one_branch_each(kernels: list[Kernel], roofline: Roofline, pick=max) -> list[Kernel]:
    """`kernels` with one branch of each conditional: its costliest on `roofline`
    (the module docstring), or its cheapest with `pick=min`; the others dropped."""
    seconds = [roofline.kernel_s(k) * k.executions for k in kernels]
    kept = pick_branches([k.branch for k in kernels], seconds, pick)
    return [k for k, keep in zip(kernels, kept, strict=True) if keep]


def estimate_step(kernels: list[Kernel], roofline: Roofline, pick=max) -> Estimate:
    """Price every kernel on `roofline` and sum them per step: one branch of each
    conditional (`one_branch_each`), so `Estimate.kernels` are the kernels priced."""
    priced_by_one_branch = conditionals([k.branch for k in kernels])
    # An empty branch's stand-in (executions 0) has done its part: being picked.
    kernels = [k for k in one_branch_each(kernels, roofline, pick) if k.executions]
    ms = [roofline.kernel_s(k) * k.executions * 1e3 for k in kernels]
    by_category: dict[str, tuple[int, int, float]] = {}
    groups: dict[str, list[int]] = {}
    for i, k in enumerate(kernels):
        n, b, t = by_category.get(k.category, (0, 0, 0.0))
        by_category[k.category] = (n + k.executions, b + k.bytes * k.executions, t + ms[i])
        groups.setdefault(k.source or f"({k.category}, no source line)", []).append(i)
    ordered = {cat: by_category[cat] for cat in CATEGORIES if cat in by_category}
    table = [
        Group(
            source,
            sum(kernels[i].executions for i in members),
            sum(kernels[i].bytes * kernels[i].executions for i in members),
            sum(kernels[i].flops * kernels[i].executions for i in members),
            sum(ms[i] for i in members),
            tuple(sorted({kernels[i].category for i in members})),
        )
        for source, members in groups.items()
    ]
    table.sort(key=lambda g: -g.ms)
    branch = "cheapest" if pick is min else "costliest"
    return Estimate(kernels, ms, ordered, table, priced_by_one_branch, branch)


def fit_calibration(
    kernels: list[Kernel],
    measured_ms: dict[str, float],
    roofline: Roofline,
    source: str = "",
    bounds: tuple[float, float] = (0.25, 50.0),
    device_attention: list[Kernel] | None = None,
) -> Calibration:
    """A Calibration whose estimate of `kernels` matches `measured_ms` per group.

    `measured_ms`: a device profile's milliseconds per step by PROFILE_GROUP
    group (benchmarks/gpu_profile.read's ``ms_per_step_by_category``). Each group's
    categories get one slowdown, (measured - launches) / roofline, kept within
    `bounds` (FIT_KEEPS' categories keep theirs, their time taken off the group's
    first); "attention (cuDNN)" sets attention_efficiency from the attention
    kernels' FLOPs and launches, or from `device_attention`'s where given: the
    attention kernels of the device's own program (a compile with cuDNN) when
    `kernels` is a stand-in whose attention does other work (a deviceless compile's
    XLA attention, where the device's cuDNN call zero-padded v to k's head dim).
    Groups the program has no kernels for, or the profile lacks, keep `roofline`'s
    factors. Raises ValueError naming an unknown group."""
    known = set(PROFILE_GROUP.values())
    for group in measured_ms:
        if group not in known:
            raise ValueError(f"measured group {group!r} is not one of {sorted(known)}")
    c = roofline.calibration
    roof: dict[str, float] = {}
    launch: dict[str, float] = {}
    kernels = one_branch_each(kernels, roofline)
    for k in kernels:
        if k.category == "attention":
            continue
        if k.category in FIT_KEEPS:  # priced as it is, and off the group's measured time
            launch[k.group] = launch.get(k.group, 0.0) + roofline.kernel_s(k) * k.executions
            continue
        roof[k.group] = roof.get(k.group, 0.0) + roofline.roof_s(k) * k.executions
        launch[k.group] = launch.get(k.group, 0.0) + c.launch_s * k.executions
    slowdown = dict(c.slowdown)
    for group, ms in measured_ms.items():
        if group == PROFILE_GROUP["attention"]:
            continue
        if roof.get(group, 0.0) <= 0:
            continue
        factor = (ms * 1e-3 - launch[group]) / roof[group]
        factor = min(max(factor, bounds[0]), bounds[1])
        for cat, grp in PROFILE_GROUP.items():
            if grp == group and cat not in FIT_KEEPS:
                slowdown[cat] = round(factor, 3)
    attention = c.attention_efficiency
    program = kernels
    if device_attention is not None:
        program = one_branch_each(device_attention, roofline)
    timed = [k for k in program if k.category == "attention" and k.flops]
    attention_flops = sum(k.flops * k.executions for k in timed)
    attention_launch = sum(c.launch_s * k.executions for k in timed)
    measured_attention = measured_ms.get(PROFILE_GROUP["attention"], 0.0)
    if attention_flops and measured_attention * 1e-3 > attention_launch:
        seconds = measured_attention * 1e-3 - attention_launch
        attention = attention_flops / (roofline.peak_flops * seconds)
    return dataclasses.replace(
        c, slowdown=slowdown, attention_efficiency=round(attention, 4), source=source
    )


def format_estimate(
    est: Estimate,
    top: int = 5,
    model_flops_per_step: float | None = None,
    peak_flops: float | None = None,
) -> list[str]:
    """Report lines: predicted ms per step (and MFU when the model's FLOPs per step
    and the chip's peak are given), the split by category, the `top` costliest
    source lines."""
    total = est.total_ms
    head = f"predicted GPU step: {total:,.1f} ms"
    if model_flops_per_step and peak_flops and total > 0:
        mfu = model_flops_per_step / (total * 1e-3 * peak_flops)
        head += f", MFU {100 * mfu:.1f}%"
    head += f" ({est.launches:,} kernels; hlo_tools.gpu_estimate roofline, no device)"
    mix = ", ".join(f"{cat} {ms:,.1f}" for cat, (_, _, ms) in est.by_category.items() if ms >= 0.05)
    lines = [head, f"  ms by category: {mix}"]
    if est.conditionals:
        lines.append(
            f"  {est.conditionals:,} conditionals (lax.cond/switch), each priced as its "
            f"{est.branch} branch: which one runs is data"
        )
    lines.append(f"  {top} costliest source lines:")
    for g in est.groups[:top]:
        lines.append(
            f"    {g.ms:8.1f} ms {g.launches:7,} kernels {g.bytes / 1e9:7.1f} GB "
            f"{g.flops / 1e12:7.1f} TFLOP  {g.source}"
        )
    return lines
