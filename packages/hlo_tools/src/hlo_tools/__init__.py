"""hlo_tools: collective accounting for compiled XLA HLO text (and, for XLA:GPU,
the kernels a step launches: `kernels_per_step` over the dump's thunk sequence,
and their predicted time: `launched_kernels` priced by `estimate_step`).

Standard library only; the helpers taking a jitted function import JAX when called.

The examples in the docstrings start from this setup: a step on 4 devices whose
microbatch loop (4 iterations) all-reduces a 256-float gradient in every
iteration, then once more after the loop; `tests/test_doctests.py` runs them all.

>>> import hlo_tools as ht
>>> HLO = '''
... HloModule step, num_partitions=4
...
... %add (a: f32[], b: f32[]) -> f32[] {
...   %a = f32[] parameter(0)
...   %b = f32[] parameter(1)
...   ROOT %s = f32[] add(%a, %b)
... }
...
... %body (p: (s32[], f32[256])) -> (s32[], f32[256]) {
...   %p = (s32[], f32[256]{0}) parameter(0)
...   %i = s32[] get-tuple-element(%p), index=0
...   %g = f32[256]{0} get-tuple-element(%p), index=1
...   %r = f32[256]{0} all-reduce(%g), replica_groups={{0,1,2,3}}, to_apply=%add
...   %one = s32[] constant(1)
...   %n = s32[] add(%i, %one)
...   ROOT %t = (s32[], f32[256]{0}) tuple(%n, %r)
... }
...
... %cond (p: (s32[], f32[256])) -> pred[] {
...   %p = (s32[], f32[256]{0}) parameter(0)
...   %i = s32[] get-tuple-element(%p), index=0
...   %lim = s32[] constant(4)
...   ROOT %lt = pred[] compare(%i, %lim), direction=LT
... }
...
... ENTRY %main (x: f32[256]) -> f32[256] {
...   %x = f32[256]{0} parameter(0)
...   %c0 = s32[] constant(0)
...   %init = (s32[], f32[256]{0}) tuple(%c0, %x)
...   %loop = (s32[], f32[256]{0}) while(%init), condition=%cond, body=%body
...   %acc = f32[256]{0} get-tuple-element(%loop), index=1
...   ROOT %out = f32[256]{0} all-reduce(%acc), replica_groups={{0,1,2,3}}, to_apply=%add
... }
... '''
"""

from hlo_tools.assertions import (
    OVERLAPPED_SCOPE,
    assert_reduced_once_per_step,
    gradient_reductions_outside,
    in_loop_reductions,
    is_gradient_reduction,
    is_ring_reduction,
    overlapped_reductions,
)
from hlo_tools.buffers import Allocation, BufferValue, loop_buffers, parse_buffer_assignment
from hlo_tools.callgraph import CallGraph, Context, Loop, call_graph
from hlo_tools.collectives import KINDS, REDUCTION_KINDS, Collective, collectives
from hlo_tools.dataflow import contracts, first_marked, reaches_root
from hlo_tools.errors import HloParseError
from hlo_tools.gpu_estimate import (
    CALIBRATION,
    Calibration,
    Estimate,
    Roofline,
    estimate_step,
    fit_calibration,
    format_estimate,
)
from hlo_tools.gpu_files import program_files, read_program
from hlo_tools.gpu_kernels import Kernel, launched_kernels, profile_group
from hlo_tools.jitted import (
    assert_jitted_reduced_once_per_step,
    compile_with_buffers,
    compiled_text,
    report_jitted,
)
from hlo_tools.lines import cross_replica_all_reduce_sizes, split_by_entry_loop
from hlo_tools.mesh_axes import axis_index, spanned_axes, spans_mesh_axis
from hlo_tools.module import Computation, HloModule, Instruction
from hlo_tools.overlap import (
    Overlap,
    async_overlap,
    format_overlap,
    overlap_report,
    overlap_summary,
    wire_bytes,
)
from hlo_tools.parser import parse, parse_instruction
from hlo_tools.report import format_table, to_json, verdict
from hlo_tools.schedule import AsyncPair, async_pairs
from hlo_tools.shapes import ArrayType, TupleType
from hlo_tools.slices import (
    crosses_slices,
    format_slice_traffic,
    slice_traffic,
    split_by_slice,
)
from hlo_tools.thunks import KernelCount, format_kernels, kernels_per_step
from hlo_tools.traffic import traffic

__version__ = "0.1.0"

__all__ = [
    "CALIBRATION",
    "Calibration",
    "Estimate",
    "Kernel",
    "Roofline",
    "estimate_step",
    "fit_calibration",
    "format_estimate",
    "launched_kernels",
    "profile_group",
    "program_files",
    "read_program",
    "KINDS",
    "REDUCTION_KINDS",
    "Allocation",
    "ArrayType",
    "AsyncPair",
    "BufferValue",
    "CallGraph",
    "Collective",
    "Computation",
    "Context",
    "HloModule",
    "HloParseError",
    "Instruction",
    "KernelCount",
    "Loop",
    "Overlap",
    "TupleType",
    "assert_jitted_reduced_once_per_step",
    "async_overlap",
    "async_pairs",
    "axis_index",
    "call_graph",
    "assert_reduced_once_per_step",
    "collectives",
    "compile_with_buffers",
    "compiled_text",
    "contracts",
    "cross_replica_all_reduce_sizes",
    "crosses_slices",
    "format_slice_traffic",
    "format_overlap",
    "format_kernels",
    "format_table",
    "gradient_reductions_outside",
    "in_loop_reductions",
    "loop_buffers",
    "overlapped_reductions",
    "OVERLAPPED_SCOPE",
    "is_gradient_reduction",
    "is_ring_reduction",
    "kernels_per_step",
    "overlap_report",
    "overlap_summary",
    "parse",
    "parse_buffer_assignment",
    "parse_instruction",
    "reaches_root",
    "first_marked",
    "report_jitted",
    "slice_traffic",
    "spanned_axes",
    "spans_mesh_axis",
    "split_by_slice",
    "split_by_entry_loop",
    "to_json",
    "traffic",
    "verdict",
    "wire_bytes",
]
