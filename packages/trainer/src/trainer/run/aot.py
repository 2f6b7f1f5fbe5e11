"""`train compile_topology=v5e-8 ...`: compile the real train step for a TPU
topology (with libtpu) or a GPU one (`h100-8`, with jax's CUDA plugin) on this
(CPU) host, without running it.

The state is built as ShapeDtypeStructs with their shardings
(`run.abstract_setup`), so even the 671B shape compiles without allocating a
parameter. Prints per-device memory from the compiled executable against the
chip's HBM, the hlo_tools collective table and the in-loop verdict, and writes
the HLO to run_dir/aot_<topology>.hlo.

Topology names follow Cloud TPU: the number counts chips for v5e and v6e and
TensorCores (two per chip) for v5p. `compile_topology_num_slices=N` compiles
for N such slices joined over DCN: the mesh's dcn_ axes (dcn_data_parallelism,
default -1: all the slices) span them, the ici_ axes one slice.
Needs libtpu: `uv run --extra tpu train compile_topology=v5e-8 ...`.

GPU topologies (gpu_topology.py) are named chip-GPUs per host (h100-8, h200-1);
`compile_topology_num_slices=K` compiles for K such hosts, the dcn_ axes across
them. Needs the gpu extra: `uv run --extra gpu train compile_topology=h100-8 ...`.
Their report adds the kernels the step launches (the thunk sequence of XLA's
dump, weighted by loop trip counts) and their mix.

`compile_for_topology` and `main` take the whole Config: they build the run
(`run.abstract_setup`) and write under run_dir; `choose_topology` takes the parallelism group.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import tempfile
from typing import Any

import jax
from jax.experimental import topologies

import accum
import hlo_tools
from trainer.config import Config, ConfigError, ParallelismConfig, mesh_shape
from trainer.model import attention_kernel
from trainer.run import gpu_estimate, gpu_topology, report, xla_options
from trainer.run import run as run_lib
from trainer.sharding.slices import slice_major
from trainer.step import reduction_choice

GIB = 1024**3


@dataclasses.dataclass(frozen=True)
class Topology:
    name: str  # v5e-8, h100-8
    libtpu_name: str  # v5e:2x4; for a GPU topology the device kind (NVIDIA H200)
    chips: int  # per slice (TPU) or per host (GPU)
    hbm_gib: float  # per chip
    platform: str = "tpu"  # or "gpu"
    chip: str = ""  # gpu_topology.CHIPS key (GPU topologies)


_GRID_2D = {
    1: "1x1",
    4: "2x2",
    8: "2x4",
    16: "4x4",
    32: "4x8",
    64: "8x8",
    128: "8x16",
    256: "16x16",
}
_GRID_3D = {
    4: "2x2x1",
    8: "2x2x2",
    16: "2x2x4",
    32: "2x4x4",
    64: "4x4x4",
    128: "4x4x8",
    256: "4x8x8",
    512: "8x8x8",
    1024: "8x8x16",
    2048: "8x16x16",
}
HBM_GIB = {"v5e": 16.0, "v6e": 32.0, "v5p": 95.0}


def _known() -> dict[str, Topology]:
    out = {}
    for gen in ("v5e", "v6e"):
        for chips, grid in _GRID_2D.items():
            out[f"{gen}-{chips}"] = Topology(f"{gen}-{chips}", f"{gen}:{grid}", chips, HBM_GIB[gen])
    for chips, grid in _GRID_3D.items():
        name = f"v5p-{2 * chips}"
        out[name] = Topology(name, f"v5p:{grid}", chips, HBM_GIB["v5p"])
    for chip_name, chip in gpu_topology.CHIPS.items():
        for gpus in gpu_topology.GPUS_PER_HOST:
            name = f"{chip_name}-{gpus}"
            out[name] = Topology(name, chip.description, gpus, chip.hbm_gib, "gpu", chip_name)
    return out


TOPOLOGIES = _known()


def choose_topology(parallelism: ParallelismConfig) -> Topology:
    """The topology named by compile_topology, and checks on the mesh it implies.

    Raises ConfigError naming the key (unknown names list the known ones); cheap,
    so it runs before libtpu loads or anything compiles.
    """
    topo = TOPOLOGIES.get(parallelism.compile_topology)
    if topo is None:
        raise ConfigError(
            f"compile_topology={parallelism.compile_topology!r} is not a known TPU or GPU "
            "topology; "
            f"known: {', '.join(TOPOLOGIES)}"
        )
    slices = parallelism.compile_topology_num_slices
    if slices < 1:
        raise ConfigError(f"compile_topology_num_slices={slices} must be >= 1")
    # The dcn_ keys must fill the slices, the ici_ keys one slice (ConfigError otherwise).
    mesh_shape(parallelism, topo.chips * slices, slices)
    return topo


def devices_for(topo: Topology, num_slices: int) -> list:
    """Compile-only TPU devices, slice-major; with several slices they carry their
    `slice_index`, so the mesh is the hybrid one (slices.device_array). For a GPU
    topology, `num_slices` hosts of its GPUs, host-major."""
    if topo.platform == "gpu":
        return gpu_topology.devices(topo.chip, topo.chips, num_slices)

    kwargs = {"num_slices": num_slices} if num_slices > 1 else {}
    return slice_major(topologies.get_topology_desc(topo.libtpu_name, "tpu", **kwargs).devices)


@dataclasses.dataclass
class AotResult:
    topology: Topology
    num_slices: int
    run: Any  # run.Run with abstract state
    compiled: Any
    hlo_path: str
    memory: dict[str, int]
    kernels: Any = None  # hlo_tools.KernelCount (GPU topologies)

    @property
    def hbm_bytes(self) -> int:
        return int(self.topology.hbm_gib * GIB)


def memory_of(compiled: Any) -> dict[str, int]:
    """Per-device bytes from the compiled executable's memory analysis.

    total = arguments + outputs - aliased (donated state reused for the new
    state) + temporaries + generated code: what the step needs resident.
    """
    m = compiled.memory_analysis()
    out = {
        "argument": int(m.argument_size_in_bytes),
        "output": int(m.output_size_in_bytes),
        "alias": int(m.alias_size_in_bytes),
        "temp": int(m.temp_size_in_bytes),
        "code": int(m.generated_code_size_in_bytes),
    }
    out["total"] = out["argument"] + out["output"] - out["alias"] + out["temp"] + out["code"]
    # XLA's peak of simultaneously live buffers (arguments included), where the
    # backend reports it: below `total` by what the temp allocation reserves
    # beyond that peak (both, measured per schedule: benchmarks/results/aot_async.md).
    # Not part of `total`.
    peak = getattr(m, "peak_memory_in_bytes", None)
    if peak:
        out["peak"] = int(peak)
    return out


def compile_for_topology(config: Config, hlo_path: str | None = None) -> AotResult:
    """Build the abstract state on the topology's devices, lower, compile, write HLO."""
    topo = choose_topology(config.parallelism)
    slices = config.compile_topology_num_slices
    devices = devices_for(topo, slices)
    run = run_lib.abstract_setup(config, devices)
    records = {}  # id(compiled) -> the trace-time record of its lowering
    dumps = {}  # id(compiled) -> its XLA dump directory (GPU: the thunk sequence)
    gpu = topo.platform == "gpu"
    user_dump = gpu_topology.user_dump_dir() if gpu else None  # XLA_FLAGS' --xla_dump_to
    scratch = tempfile.mkdtemp(prefix="tagtrain_aot_") if gpu and not user_dump else None

    def compile_run(run):
        # The record names the parameters in a TagLostError's message.
        with jax.set_mesh(run.ctx.mesh), accum.verdict.recording() as record:
            lowered = run.step_fn.lower(run.state, run_lib.abstract_batch(run))
        with jax.set_mesh(run.ctx.mesh):
            # The mesh holds the topology's devices, so this is their platform's
            # option set (TPU's flags; none for a GPU).
            options = xla_options.for_mesh(run.config.parallelism, run.ctx.mesh)
            if scratch:  # one directory per compile: auto may compile several policies
                options["xla_dump_to"] = tempfile.mkdtemp(dir=scratch)
            # the user's dump directory (XLA dumps there already): this compile's files
            # are those that were not there before it
            earlier = gpu_topology.thunk_sequences(user_dump) if user_dump else set()
            compiled = lowered.compile(compiler_options=options)
        records[id(compiled)] = record
        dumps[id(compiled)] = (user_dump or options.get("xla_dump_to"), earlier)
        return compiled

    def rebuild(choice):  # the next policy auto's order offers, on the same spec
        return run_lib.build(run.spec.with_policy(choice.policy, choice), abstract=True)

    try:
        # gradient_reduction_policy=auto: a step over HBM gives way to the next policy.
        run, compiled = reduction_choice.compile_first_fitting(
            run, compile_run, rebuild, int(topo.hbm_gib * GIB), lambda c: memory_of(c)["total"]
        )
        record = records[id(compiled)]
        run.compiled = compiled
        suffix = f"x{slices}" if slices > 1 else ""
        hlo_path = hlo_path or os.path.join(config.run_dir, f"aot_{topo.name}{suffix}.hlo")
        os.makedirs(os.path.dirname(os.path.abspath(hlo_path)), exist_ok=True)
        text = compiled.as_text()
        with open(hlo_path, "w") as f:
            f.write(text)
        kernels = None
        if gpu:  # the thunk sequence is kept beside the HLO, for a reader
            thunks_path = hlo_path.removesuffix(".hlo") + ".thunks.txt"
            dump, earlier = dumps[id(compiled)]
            kernels = gpu_topology.kernels_of_dump(dump, text, thunks_path, earlier)
    finally:
        if scratch:  # our own dump (LLVM IR, PTX of every kernel) is large: not kept
            shutil.rmtree(scratch, ignore_errors=True)
    # After writing the HLO, so a TagLostError's program can be inspected.
    accum.check_compiled(text, "raise", record)
    return AotResult(topo, slices, run, compiled, hlo_path, memory_of(compiled), kernels)


def report_lines(result: AotResult) -> list[str]:
    """What `train compile_topology=...` prints."""
    run, topo, mem = result.run, result.topology, result.memory
    config = run.config
    slices = f" x {result.num_slices} slices" if result.num_slices > 1 else ""
    devices = run.ctx.mesh.size
    if topo.platform == "gpu":
        slices = f" x {result.num_slices} hosts" if result.num_slices > 1 else ""
        where = f"{topo.chips} x {topo.libtpu_name} per host, {devices} GPUs"
    else:
        where = f"{topo.libtpu_name}, {devices} chips"
    lines = [
        f"topology: {topo.name}{slices} ({where}, "
        f"{topo.hbm_gib:g} GiB HBM each); compiled on this host, not run",
        report.mesh_line(dict(run.ctx.mesh.shape), config.shard_mode),
        report.params_line_of(config.model, run.state.get("frozen", run.state["params"])),
        *report.lora_lines(config.model, run.state),
        report.batch_line(config.accumulation, config.data, run.batch_size),
        *report.pipeline_lines(config, dict(run.ctx.mesh.shape)),
        *(reduction_choice.startup_lines(run.reduction_choice) if run.reduction_choice else []),
        *report.plan_lines(config.accumulation, run.plan),
        attention_kernel.describe(config.model, run.ctx, config.data.max_target_length),
        "memory per device (compiled.memory_analysis()):",
    ]
    for key in ("argument", "output", "alias", "temp", "code"):
        lines.append(f"  {key:9s} {mem[key] / GIB:9.3f} GiB")
    if "peak" in mem:
        lines.append(
            f"  peak      {mem['peak'] / GIB:9.3f} GiB (live buffers at once, XLA's count)"
        )
    share = mem["total"] / result.hbm_bytes
    fits = "fits" if share <= 1 else "DOES NOT FIT"
    lines.append(
        f"  total     {mem['total'] / GIB:9.3f} GiB of {topo.hbm_gib:g} GiB HBM "
        f"({share * 100:.1f}%, {fits})"
    )
    if topo.platform == "gpu":
        lines += filter(None, [gpu_topology.allocator_line(mem["total"], topo.hbm_gib)])
    text = result.compiled.as_text()
    lines += report.collective_summary(
        text, config.accumulation, *run_lib.summary_axes(run), shard_mode=config.shard_mode
    )
    # The table without hlo_tools' generic verdict: the summary above knows which
    # mesh axes may reduce per iteration (FSDP's) and which may not.
    lines += hlo_tools.format_table(hlo_tools.parse(text), verdict_line=False).splitlines()
    if result.kernels is not None:
        lines += gpu_topology.report_lines(result.kernels, run, result.hlo_path)
        lines += gpu_estimate.report_lines(result)
    command = run_lib.hlo_report_command(run, result.hlo_path)
    lines.append(f"wrote compiled HLO to {result.hlo_path} (inspect with: {command})")
    return lines


def main(config: Config, hlo_path: str | None = None) -> int:
    """`train compile_topology=...`: compile, print the report; 1 when it does not fit."""
    topo = choose_topology(config.parallelism)  # ConfigError before libtpu loads
    if topo.platform == "gpu":
        gpu_topology.require_plugin()  # ConfigError: how to install it
    print(f"model: {config.model_name}", flush=True)
    try:
        result = compile_for_topology(config, hlo_path)
    except jax.errors.JaxRuntimeError as error:
        message = str(error)
        if "RESOURCE_EXHAUSTED" not in message:
            raise
        print(
            f"memory per device: DOES NOT FIT on {topo.name} ({topo.hbm_gib:g} GiB HBM per "
            f"chip); XLA: {message.strip().splitlines()[0]}",
            flush=True,
        )
        return 1
    for line in report_lines(result):
        print(line, flush=True)
    return 0 if result.memory["total"] <= result.hbm_bytes else 1
