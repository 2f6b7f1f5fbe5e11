"""What each kernel of an XLA:GPU program moves and computes: the inputs of the
GPU step-time estimate (gpu_estimate.py).

`launched_kernels(sequence, metadata, hlo_text)` walks XLA's thunk sequence (thunks.py:
every thunk that launches work, with its executions per step) and reads, from
the optimized HLO, the instruction each thunk runs (thunk metadata's profile
annotation), giving a Kernel per launching thunk:

* **bytes** read and written per execution: the fusion's operand and result
  arrays, except where a fused computation touches only part of a buffer: a
  parameter read only through dynamic-slice/slice/gather counts those results
  (a scanned layer's weights out of the stacked array), and an in-place
  dynamic-update-slice or scatter into a parameter counts the update written,
  not the whole buffer (XLA:GPU aliases it). Caches are not modelled: every
  byte is an HBM byte.
* **flops**: 2 x result elements x contracted size of every dot in it (a Triton
  GEMM fusion's dot, cuBLAS's ``__cublas$gemm`` custom call); cuDNN's attention
  custom calls (``__cudnn$fmha*``) as the XLA attention they replace; a Pallas
  Mosaic-GPU kernel (``mosaic_gpu*``) whose shapes are a grouped matmul's
  (`grouped_matmul_flops`: moe_kernels' grouped GEMM) as that matmul, and it is a
  "matmul" kernel; 0 for the rest.
* **category**: read from the kernel's name as a profiler shows it (XLA names a
  fusion after its hero: ``loop_broadcast_fusion``, ``input_reduce_fusion``),
  in the order benchmarks/gpu_profile.py reads a device trace
  (`profile_group`), so an estimate and a measured profile split the same way;
  the fused root's opcode decides when the name says nothing. Kernels inside
  a function named in ``attention_functions`` (the model's XLA attention,
  which a GPU runs as one cuDNN kernel) are "attention".
* **source**: the innermost frame of the instruction's call stack outside
  site-packages (hlo_tools.frames), ``file:line (function)``.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

from hlo_tools.frames import Frame, StackFrames
from hlo_tools.module import Computation, HloModule, Instruction
from hlo_tools.parser import parse
from hlo_tools.shapes import leaf_arrays
from hlo_tools.thunks import Branch, launches

# Categories in the order a kernel's name is tested (first match wins). The order
# and keywords follow benchmarks/gpu_profile.py's reading of a device trace (it
# imports NAME_KEYWORDS), so a predicted and a measured split agree kernel by kernel.
NAME_KEYWORDS = (
    # cuDNN's fused kernels' names also hold "sm90" and "gemm": attention first.
    ("attention", ("cudnn", "fmha", "flash", "sdpa")),
    ("matmul", ("gemm", "nvjet", "cutlass", "xmma", "cublas", "sm90_", "dot", "matmul")),
    ("transpose", ("transpose",)),
    ("copy", ("memcpy", "copy", "memset")),
    ("dynamic-update-slice", ("dynamic_update_slice", "dynamic-update-slice")),
    ("dynamic-slice", ("dynamic_slice", "dynamic-slice")),
    ("convert", ("convert",)),
    ("broadcast", ("broadcast",)),
    ("reduce", ("reduce",)),
    ("select", ("select",)),
    ("scatter", ("scatter",)),
    ("sort", ("sort",)),
    ("gather", ("gather",)),
    ("concatenate", ("concatenate",)),
    ("collective", ("nccl", "all_reduce", "all-reduce", "all_gather", "reduce_scatter")),
    ("slice/pad", ("slice", "pad")),
)
# Every category an estimate reports, with the device profile's coarser group
# (device_check.md's table) it is compared and refit against.
PROFILE_GROUP = {
    "attention": "attention (cuDNN)",
    "matmul": "matmul",
    "transpose": "transpose",
    "copy": "copy",
    "dynamic-update-slice": "dynamic-update-slice",
    "dynamic-slice": "dynamic-slice",
    "convert": "convert",
    "broadcast": "broadcast",
    "reduce": "reduce",
    "select": "select",
    "scatter": "scatter/sort/gather",
    "sort": "scatter/sort/gather",
    "gather": "scatter/sort/gather",
    "concatenate": "scatter/sort/gather",
    "collective": "collective",
    "slice/pad": "other",
    "elementwise": "other",
    "other": "other",
}
CATEGORIES = tuple(PROFILE_GROUP)
_ELEMENTWISE = {
    "add", "subtract", "multiply", "divide", "maximum", "minimum", "exponential", "log",
    "negate", "abs", "sqrt", "rsqrt", "tanh", "logistic", "power", "compare", "and", "or",
    "not", "xor", "clamp", "exponential-minus-one", "log-plus-one", "sign", "floor", "ceil",
    "round-nearest-even", "round-nearest-afz", "iota", "constant", "bitcast", "reshape",
    "is-finite", "remainder", "shift-left", "shift-right-logical", "erf", "cosine", "sine",
}  # fmt: skip
_ROOT_CATEGORY = {
    "dot": "matmul",
    "convolution": "matmul",
    "transpose": "transpose",
    "copy": "copy",
    "dynamic-update-slice": "dynamic-update-slice",
    "dynamic-slice": "dynamic-slice",
    "convert": "convert",
    "broadcast": "broadcast",
    "reduce": "reduce",
    "reduce-window": "reduce",
    "select": "select",
    "scatter": "scatter",
    "sort": "sort",
    "gather": "gather",
    "concatenate": "concatenate",
    "slice": "slice/pad",
    "pad": "slice/pad",
}
_KIND_CATEGORY = {
    "kGemm": "matmul",
    "kCublasLtMatmul": "matmul",
    "kConvolution": "matmul",
    "kCuDnn": "attention",
    "kCopy": "copy",
    "kDeviceToDevice": "copy",
    "kMemset32BitValue": "copy",
    "kMemzero": "copy",
}
# Reads of a fused parameter that touch only part of it (their results count).
_PARTIAL_READS = {"dynamic-slice", "slice", "gather"}
# In-place writes into operand 0 (XLA:GPU aliases the buffer): (opcode, update operand).
_IN_PLACE = {"dynamic-update-slice": 1, "scatter": 2}
_DIMS = re.compile(r"\{([\d,\s]*)\}")
_SITE = ("site-packages", "dist-packages", "<frozen")
MOSAIC_GPU = "mosaic_gpu"  # Pallas Mosaic-GPU kernels' custom calls (mosaic_gpu_v2, ...)
EMPTY_BRANCH = "(empty branch)"  # the name of an empty conditional branch's Kernel
CUDNN_ATTENTION = "__cudnn$fmha"  # XLA's cuDNN attention custom calls (forward, backward)


@dataclass(frozen=True)
class Kernel:
    """One launching thunk of a step: the figures the estimate prices.

    ``bytes`` and ``flops`` are per execution; ``executions`` per step (the trip
    counts of the loops around it). ``instruction`` is the HLO instruction it runs
    ("" when the metadata names none); ``source`` its innermost project frame. A
    conditional branch that launches nothing is one Kernel named EMPTY_BRANCH that
    runs 0 times (so a branch can be picked as the cheapest)."""

    thunk_id: int
    name: str
    instruction: str
    kind: str
    category: str
    bytes: int
    flops: int
    executions: int
    source: str
    loop: str
    branch: Branch = ()  # the conditional branches it runs in (thunks.Branch)

    @property
    def group(self) -> str:
        """The device profile's group of this kernel's category (PROFILE_GROUP)."""
        return PROFILE_GROUP[self.category]


def name_category(name: str) -> str | None:
    """The category a kernel's name says (NAME_KEYWORDS, first match), None when
    it names none of them."""
    low = name.lower()
    for cat, keys in NAME_KEYWORDS:
        if any(k in low for k in keys):
            return cat
    return None


def profile_group(kernel_name: str) -> str:
    """The device profile's group of a kernel as a trace names it (what
    benchmarks/gpu_profile.py sums by); "other" when no keyword matches."""
    cat = name_category(kernel_name)
    return PROFILE_GROUP[cat] if cat else "other"


def launched_kernels(
    thunk_sequence_text: str,
    thunk_metadata_text: str,
    hlo_text: str,
    attention_functions: tuple[str, ...] = (),
    through: tuple[str, ...] = (),
    module: HloModule | None = None,
) -> list[Kernel]:
    """A Kernel per launching thunk, in sequence order (module docstring), from
    the files of one compile: its thunk sequence and metadata and its optimized
    HLO text (`module`: that text already parsed, to skip parsing it again).

    `attention_functions`: function names (as the HLO's FunctionNames table
    spells them, e.g. ``MLA._dot_product``) whose kernels are "attention";
    `through`: helper functions a kernel's source line looks past to their caller
    (a wrapper every matmul goes through, like ``ShardCtx.einsum``)."""
    module = module if module is not None else parse(hlo_text)
    table = _instructions(module)
    frames = StackFrames(hlo_text)
    out, arms = [], []
    for launch in launches(thunk_sequence_text, thunk_metadata_text, module, arms=arms):
        found = table.get(launch.instruction)
        instr, comp = found if found else (None, None)
        stack = _stack(frames, module, instr) if instr is not None else []
        cat = _category(launch.kind, launch.name, module, instr)
        if attention_functions and any(f.function in attention_functions for f in stack):
            cat = "attention"
        out.append(
            Kernel(
                launch.thunk_id,
                launch.name,
                launch.instruction,
                launch.kind,
                cat,
                instruction_bytes(module, instr, comp) if instr is not None else 0,
                instruction_flops(module, instr, comp) if instr is not None else 0,
                launch.executions,
                _source(stack, through),
                launch.loop,
                launch.branch,
            )
        )
    # A branch that launches nothing (lax.cond's identity branch) is a kernel that
    # runs 0 times: the cheapest branch a conditional can take, when one is picked.
    taken = {k.branch[:depth] for k in out for depth in range(1, len(k.branch) + 1)}
    for arm in arms:
        if arm not in taken:
            out.append(Kernel(-1, EMPTY_BRANCH, "", "kConditional", "other", 0, 0, 0, "", "", arm))
    return out


def _instructions(module: HloModule) -> dict[str, tuple[Instruction, Computation]]:
    return module.derived(
        "instructions_by_name",
        lambda m: {i.name: (i, c) for c in m.computations.values() for i in c.instructions},
    )


def _stack(frames: StackFrames, module: HloModule, instr: Instruction) -> list[Frame]:
    stack = frames.of(instr)
    if not stack and instr.opcode == "fusion":
        fused = _fused(module, instr)
        if fused is not None:
            stack = frames.of(fused.root)
    if not stack and instr.opcode == "copy" and instr.operands:
        # XLA's copy insertion keeps no metadata: the copied value's line says why.
        found = _instructions(module).get(instr.operands[0])
        if found is not None and found[0].opcode != "copy":
            stack = _stack(frames, module, found[0])
    return stack


def _source(stack: list[Frame], through: tuple[str, ...] = ()) -> str:
    """The innermost frame outside installed packages and the `through` helpers,
    its path from the last ``src/`` (or its last three parts); "" when the
    stack is empty."""
    for frame in stack:
        if not any(s in frame.file for s in _SITE) and frame.function not in through:
            path = frame.file.rsplit("/src/", 1)[-1]
            if path == frame.file:
                path = "/".join(frame.file.split("/")[-3:])
            return str(Frame(path, frame.line, frame.function))
    return str(stack[0]) if stack else ""


def _fused(module: HloModule, instr: Instruction) -> Computation | None:
    called = [name for key, name in instr.called() if key == "calls"]
    return module.computations.get(called[0]) if called else None


def _category(kind: str, name: str, module: HloModule, instr: Instruction | None) -> str:
    if kind in _KIND_CATEGORY:
        return _KIND_CATEGORY[kind]
    if any(word in kind for word in ("AllReduce", "AllGather", "ReduceScatter", "AllToAll")):
        return "collective"
    if any(word in kind for word in ("CollectivePermute", "Send", "Recv", "Nccl")):
        return "collective"
    by_name = name_category(name)
    if by_name:
        return by_name
    if instr is None:
        return "other"
    root = instr
    if instr.opcode == "fusion":
        fused = _fused(module, instr)
        root = fused.root if fused is not None else instr
        if root.opcode == "tuple" and fused is not None and root.operands:
            root = fused.by_name.get(root.operands[0], root)
    if root.opcode in _ROOT_CATEGORY:
        return _ROOT_CATEGORY[root.opcode]
    target = root.attributes.get("custom_call_target", "").strip('"')
    target = target if root.opcode == "custom-call" else ""
    if target.startswith(CUDNN_ATTENTION):
        return "attention"
    if "gemm" in target:
        return "matmul"
    if target.startswith(MOSAIC_GPU) and _is_grouped_matmul(module, root):
        return "matmul"
    return "elementwise" if root.opcode in _ELEMENTWISE else "other"


def _type_bytes(comp: Computation, name: str) -> int:
    instr = comp.by_name.get(name)
    return sum(a.bytes for a in leaf_arrays(instr.type)) if instr is not None else 0


def instruction_bytes(module: HloModule, instr: Instruction, comp: Computation) -> int:
    """Bytes one execution of `instr` reads and writes (module docstring)."""
    results = leaf_arrays(instr.type)
    if instr.opcode == "custom-call" and len(results) > 1:
        results = results[:1]  # cuBLAS's result, not its workspace
    written = sum(a.bytes for a in results)
    fused = _fused(module, instr) if instr.opcode == "fusion" else None
    if fused is None:
        return written + sum(_type_bytes(comp, op) for op in instr.operands)
    params = {int(i.literal or 0): i for i in fused.instructions if i.opcode == "parameter"}
    users = _users(fused)
    read = 0
    for index, operand in enumerate(instr.operands):
        param = params.get(index)
        full = _type_bytes(comp, operand)
        read += _read_bytes(fused, users, param, full) if param is not None else full
    roots = [fused.root]
    if fused.root.opcode == "tuple":
        roots = [fused.by_name[o] for o in fused.root.operands if o in fused.by_name]
    for root, array in zip(roots, results, strict=False):
        slot = _IN_PLACE.get(root.opcode)
        if slot is not None and len(root.operands) > slot:
            # Written in place: the update's bytes, not the whole buffer's.
            written += _type_bytes(fused, root.operands[slot]) - array.bytes
    return read + written


def _users(comp: Computation) -> dict[str, list[tuple[Instruction, int]]]:
    table: dict[str, list[tuple[Instruction, int]]] = {}
    for instr in comp.instructions:
        for position, operand in enumerate(instr.operands):
            table.setdefault(operand, []).append((instr, position))
    return table


def _read_bytes(comp: Computation, users, param: Instruction, full: int) -> int:
    """What a fused computation reads of one parameter: the parts its slicing
    users take, nothing when it only receives an in-place update, else all of it."""
    frontier, partial = [param], 0
    while frontier:
        node = frontier.pop()
        for user, position in users.get(node.name, []):
            if user.opcode == "bitcast":
                frontier.append(user)
            elif user.opcode in _PARTIAL_READS and position == 0:
                partial += sum(a.bytes for a in leaf_arrays(user.type))
            elif user.opcode in _IN_PLACE and position == 0:
                continue
            else:
                return full
    return min(partial, full)


def instruction_flops(module: HloModule, instr: Instruction, comp: Computation) -> int:
    """Matmul FLOPs of one execution: its dots (inside a fusion too) and cuBLAS
    GEMM custom calls, 2 x result elements x contracted size each."""
    if instr.opcode == "dot":
        return _dot_flops(comp, instr, instr.attributes.get("lhs_contracting_dims", "{}"))
    if instr.opcode == "custom-call":
        target = instr.attributes.get("custom_call_target", "").strip('"')
        if target.startswith(CUDNN_ATTENTION):
            return _cudnn_attention_flops(comp, instr, "Backward" in target)
        if target.startswith(MOSAIC_GPU):
            return grouped_matmul_flops(comp, instr)
        if "gemm" not in target.lower() and "matmul" not in target.lower():
            return 0
        try:
            config = json.loads(instr.attributes.get("backend_config", "{}"))
            dims = config["gemm_backend_config"]["dot_dimension_numbers"]
            contracting = "{" + ",".join(dims.get("lhs_contracting_dimensions", [])) + "}"
        except (ValueError, KeyError, TypeError):
            return 0
        return _dot_flops(comp, instr, contracting)
    total = 0
    for key, name in instr.called():
        if key in ("calls", "called_computations") and name in module.computations:
            callee = module.computations[name]
            total += sum(instruction_flops(module, i, callee) for i in callee.instructions)
    return total


def _cudnn_attention_flops(comp: Computation, instr: Instruction, backward: bool) -> int:
    """cuDNN attention counted as the XLA attention it replaces is: the score and value
    products over the full (S, T) square (no causal discount), 2 of them forward, 4
    backward. q, k, v are the first three operands, laid out (B, S, H, D) as jax's
    cuDNN call passes them."""
    shapes = []
    for name in instr.operands[:3]:
        operand = comp.by_name.get(name)
        if operand is None:
            return 0
        shapes.append(leaf_arrays(operand.type)[0].dims)
    if len(shapes) < 3 or any(len(d) != 4 for d in shapes):
        return 0
    (b, s, h, d), t, dv = shapes[0], shapes[1][1], shapes[2][3]
    forward = 2 * b * h * s * t * (d + dv)
    return 2 * forward if backward else forward


def grouped_matmul_flops(comp: Computation, instr: Instruction) -> int:
    """A Mosaic-GPU kernel's FLOPs where its shapes are a grouped matmul's; else 0.

    A kernel's custom call says nothing of what it computes, so the shapes decide,
    as for moe_kernels/gemm_mgpu.py's two kernels: rows (M, K) times one of G
    weights (G, K, N) or (G, N, K) into (M, N), each row through one group:
    2 x M x K x N; or two row-ragged (R, M) and (R, N) into per-group products
    (G, M, N): 2 x R x M x N (each row counted in one group)."""
    operands = [comp.by_name.get(name) for name in instr.operands]
    dims = [leaf_arrays(o.type)[0].dims for o in operands if o is not None]
    out = leaf_arrays(instr.type)[0].dims
    rows, weights = [d for d in dims if len(d) == 2], [d for d in dims if len(d) == 3]
    if len(out) == 2:
        for m, k in rows:
            if m == out[0] and any(sorted(w[1:]) == sorted((k, out[1])) for w in weights):
                return 2 * m * k * out[1]
    if len(out) == 3:
        for r, m in rows:
            if m == out[1] and any(d == (r, out[2]) for d in map(tuple, rows)):
                return 2 * r * m * out[2]
    return 0


def _is_grouped_matmul(module: HloModule, instr: Instruction) -> bool:
    found = _instructions(module).get(instr.name)
    return found is not None and grouped_matmul_flops(found[1], instr) > 0


def _dot_flops(comp: Computation, instr: Instruction, contracting: str) -> int:
    lhs = comp.by_name.get(instr.operands[0]) if instr.operands else None
    if lhs is None:
        return 0
    lhs_dims = leaf_arrays(lhs.type)[0].dims
    m = _DIMS.search(contracting)
    size = 1
    for d in m.group(1).split(",") if m else []:
        if d.strip():
            size *= lhs_dims[int(d)]
    return 2 * leaf_arrays(instr.type)[0].elements * size
