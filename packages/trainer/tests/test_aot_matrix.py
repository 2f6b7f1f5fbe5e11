"""Issue 7's parallelism matrix compiled for TPU topologies on this CPU host (aot tier).

tagtrain-test, GA=4, per_device_batch_size=1 (per microbatch), compiled (never run) for v5e-8
(`v5e:2x4`) and v5p-16 (`v5p:2x2x2`, 8 chips) in explicit and in auto mode. What is
asserted is placement only: in explicit mode, wherever the mesh has a `data` axis
(data+expert, data+zero1, data+fsdp), no floating-point gradient reduction whose
replica groups span `data` runs inside a loop, and one does run after the loops.
FSDP reduce-scatters (per microbatch, inherent) and auto mode are recorded, not
asserted; `benchmarks/bench_aot_matrix.py` writes the whole table (memory and
collective bytes per step) to `benchmarks/results/aot_matrix.md` from `compile_case`.

Each compile takes ~20 s on a 2-core host: the three explicit data-axis layouts on
v5e-8 run in the aot tier; the full matrix (36 compiles) is also marked slow:

    JAX_PLATFORMS=cpu uv run --extra tpu pytest -m "aot and slow" \\
        packages/trainer/tests/test_aot_matrix.py
"""

from __future__ import annotations

import dataclasses
import functools
import tempfile

import pytest

import hlo_tools
import pspec_tags as pt
from trainer.step import reduction_bytes
from trainer_tests_layouts import EIGHT_DEVICE_LAYOUTS

pytestmark = pytest.mark.aot

# The named 8-device layouts (issue 7's matrix plus data and data x fsdp, the FSDP
# case where deferral over 'data' applies).
LAYOUTS = EIGHT_DEVICE_LAYOUTS
DATA_LAYOUTS = [name for name, o in LAYOUTS.items() if int(o["ici_data_parallelism"]) > 1]
TOPOLOGIES = ("v5e-8", "v5p-16")
MODES = pt.MODES
BASE = {
    "model_name": "tagtrain-test",
    "gradient_accumulation_steps": "4",
    "per_device_batch_size": "1",
}


@dataclasses.dataclass(frozen=True)
class Case:
    """What one compile of the matrix measured (per device, per optimizer step)."""

    topology: str
    layout: str
    mode: str
    defer: bool
    mesh: dict
    memory: dict  # aot.memory_of: argument, output, alias, temp, code, total
    hbm_bytes: int
    in_loop_bytes: int  # every collective inside a loop, weighted by trip counts
    outside_bytes: int
    by_kind: dict  # (where, kind) -> bytes per step
    data_grad_in_loop: tuple  # float reductions > 8 elements spanning 'data', in a loop
    data_grad_outside: tuple
    exact: bool  # every loop trip count known
    # Gradient operand bytes per batch axis per step (trainer.step.reduction_bytes):
    # accum.cost's prediction from the plan, and hlo_tools' count on this compile.
    predicted_bytes: tuple = ({}, {})  # (in loop, after the loop)
    counted_bytes: tuple = ({}, {})
    exact_axes: tuple = ()  # axes whose in-loop bytes the prediction covers

    @property
    def data_grad_in_loop_bytes(self) -> int:
        return sum(c.bytes_per_step or c.bytes for c in self.data_grad_in_loop)

    @property
    def data_grad_outside_bytes(self) -> int:
        return sum(c.bytes for c in self.data_grad_outside)


def spans_data(collective, mesh_shape: dict) -> bool:
    """Whether a collective's replica groups join devices with different 'data' indices."""
    return hlo_tools.spans_mesh_axis(collective, mesh_shape, "data")


def gradient_reductions(module, mesh_shape: dict) -> tuple[list, list]:
    """(in-loop, outside) floating-point reductions larger than 8 elements over 'data'.

    Integer ones are the router's per-expert token counts, summed per microbatch on
    purpose; they are not gradients."""
    if mesh_shape["data"] == 1:
        return [], []
    found = {True: [], False: []}
    for c in hlo_tools.collectives(module):
        if (
            c.kind in hlo_tools.REDUCTION_KINDS
            and c.elements > 8
            and not c.dtype.startswith(("s", "u", "pred"))
            and spans_data(c, mesh_shape)
        ):
            found[c.in_loop].append(c)
    return found[True], found[False]


@functools.cache
def compile_case(topology: str, layout: str, mode: str, defer: bool = True, **extra) -> Case:
    """Compile tagtrain-test for `topology` with one layout; summarize memory and traffic."""
    from trainer.config import make_config
    from trainer.run import aot

    overrides = {
        **BASE,
        **LAYOUTS[layout],
        "compile_topology": topology,
        "shard_mode": mode,
        "gradient_reduction_policy": "deferred" if defer else "per_microbatch",
        "base_output_directory": tempfile.mkdtemp(prefix="aot_matrix_"),
        **extra,
    }
    result = aot.compile_for_topology(make_config(overrides))
    module = hlo_tools.parse(result.compiled.as_text())
    batch_axes = result.run.plan.batch_axes
    flows = hlo_tools.traffic(module)
    mesh_shape = dict(result.run.ctx.mesh.shape)
    inside, outside = gradient_reductions(module, mesh_shape)
    by_kind = {
        (where, kind): row["bytes_per_step"]
        for where in ("in_loop", "outside")
        for kind, row in flows[where].items()
    }
    return Case(
        topology=topology,
        layout=layout,
        mode=mode,
        defer=defer,
        mesh={k: v for k, v in mesh_shape.items() if v > 1},
        memory=result.memory,
        hbm_bytes=result.hbm_bytes,
        in_loop_bytes=sum(r["bytes_per_step"] for r in flows["in_loop"].values()),
        outside_bytes=sum(r["bytes_per_step"] for r in flows["outside"].values()),
        by_kind=by_kind,
        data_grad_in_loop=tuple(inside),
        data_grad_outside=tuple(outside),
        exact=flows["exact"],
        predicted_bytes=reduction_bytes.predicted(result.run) if mode == "explicit" else ({}, {}),
        counted_bytes=reduction_bytes.counted(module, mesh_shape, batch_axes),
        exact_axes=reduction_bytes.exact_axes(result.run),
    )


def _describe(collectives) -> str:
    return "\n".join(
        f"  {c.kind} {c.type_str} x{c.multiplier}/step loops {c.loop_path} op_name {c.op_name}"
        for c in collectives
    )


def check_explicit_placement(case: Case) -> None:
    """The matrix's assertion: no 'data' gradient reduction in a loop, one outside."""
    assert case.mode == "explicit" and case.defer
    assert not case.data_grad_in_loop, (
        f"{case.topology} {case.layout}: gradient reductions over 'data' inside a loop:\n"
        + _describe(case.data_grad_in_loop)
    )
    assert case.data_grad_outside, f"{case.topology} {case.layout}: no 'data' reduction outside"


def check_predicted_bytes(case: Case) -> None:
    """accum.cost's gradient bytes per batch axis equal hlo_tools' count on the compile.

    After the loop: every batch axis, byte for byte (ZeRO-1 included: the small
    master shards XLA:TPU gathers back as all-reduces of zero-padded buffers are
    gathers, which reduction_bytes tells apart). In the loop: the axes no leaf
    reduces per use (FSDP's own reduce-scatters are not the plan's) and that shard
    only the batch (docs/cost_model.md, "Which bytes are exact")."""
    (pred_in, pred_out), (got_in, got_out) = case.predicted_bytes, case.counted_bytes
    for axis in case.exact_axes:
        assert got_in[axis] == pred_in[axis], (case.layout, axis, got_in, pred_in)
    for axis in pred_out:
        assert got_out[axis] == pred_out[axis], (case.layout, axis, got_out, pred_out)


@pytest.fixture(scope="module", autouse=True)
def _needs_libtpu():
    pytest.importorskip("libtpu", reason="needs the tpu extra (libtpu): uv run --extra tpu")


@pytest.mark.parametrize("layout", DATA_LAYOUTS)
def test_v5e8_explicit_ga4_no_data_gradient_reduction_in_the_loop(layout):
    case = compile_case("v5e-8", layout, "explicit")
    check_explicit_placement(case)
    assert case.exact
    check_predicted_bytes(case)
    assert 0 < case.memory["total"] < case.hbm_bytes


# Depth 2 (the shared embedding and head used three times, two MTP depths) in the aot
# tier; depth 1 in slow_aot (the cpu tier's test_mtp checks its ZeRO-1 GA=4 step).
@pytest.mark.parametrize("depth", [pytest.param("1", marks=pytest.mark.slow), "2"])
def test_v5e8_mtp_keeps_data_gradient_reductions_out_of_the_loop(depth):
    """Multi-token prediction (ZeRO-1, fused): its shared embedding and head, used
    twice per microbatch, and its own depths reduce once per step too."""
    case = compile_case("v5e-8", "data+zero1", "explicit", mtp_num_layers=depth)
    check_explicit_placement(case)
    assert 0 < case.memory["total"] < case.hbm_bytes


PER_MICROBATCH_EXACT = [
    pytest.param("v5e-8", "data+fsdp", id="v5e-8-data+fsdp"),
    pytest.param("v5e-8", "data+expert", id="v5e-8-data+expert"),
    pytest.param("v5e-8", "data", id="v5e-8-data", marks=pytest.mark.slow),
    pytest.param("v5e-8", "data+zero1", id="v5e-8-data+zero1", marks=pytest.mark.slow),
    pytest.param("v5p-16", "data+expert", id="v5p-16-data+expert", marks=pytest.mark.slow),
]


@pytest.mark.parametrize("topology,layout", PER_MICROBATCH_EXACT)
def test_per_microbatch_bytes_equal_the_cost_model(topology, layout):
    # accum.cost moves what XLA moves: the leaves the loop only sums (outside the
    # layer scans, and the one-layer dense stack, whose scan XLA unrolls) are
    # reduced once after the loop in their own dtype; the MoE stack's, per layer in
    # its backward scan, stay, and so does the embedding's under FSDP (its lookup
    # sums the gathered table, then slices it). docs/cost_model.md, "What XLA moves".
    case = compile_case(topology, layout, "explicit", defer=False)
    assert case.data_grad_in_loop and case.data_grad_outside
    check_predicted_bytes(case)
    (pred_in, pred_out), _ = case.predicted_bytes, case.counted_bytes
    assert case.exact_axes and all(pred_in[a] > 0 < pred_out[a] for a in case.exact_axes)


def test_v5e8_per_microbatch_data_reduction_is_detected():
    # The detector is not vacuous: without deferral the 'data' reductions move in
    # (the same compile as the data+fsdp case above).
    case = compile_case("v5e-8", "data+fsdp", "explicit", defer=False)
    assert case.data_grad_in_loop


MATRIX = [
    pytest.param(
        t,
        name,
        mode,
        id=f"{t}-{name}-{mode}",
    )
    for t in TOPOLOGIES
    for name in LAYOUTS
    for mode in MODES
]


@pytest.mark.slow
@pytest.mark.parametrize("topology,layout,mode", MATRIX)
def test_matrix_compiles_and_places_reductions(topology, layout, mode):
    case = compile_case(topology, layout, mode)
    assert 0 < case.memory["total"] < case.hbm_bytes, case.memory
    assert case.outside_bytes > 0
    if mode == "explicit" and layout in DATA_LAYOUTS:
        check_explicit_placement(case)
    if mode == "explicit":
        check_predicted_bytes(case)
    # auto mode: XLA places the reductions; recorded in aot_matrix.md, not asserted.
