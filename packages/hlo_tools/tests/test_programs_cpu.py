"""The gradient-accumulation programs compiled here on 8 CPU devices."""

import re

import pytest

import hlo_tools as ht


def _all_reduce_lines(text):
    # Independent of the parser: every line whose opcode is all-reduce.
    return [ln for ln in text.splitlines() if re.search(r"\sall-reduce(-start)?\(", ln)]


def _loop_result_reduced(module, name):
    """The while loop whose result the ENTRY instruction `name` reduces, through the
    layout changes (bitcast, copy, reshape) and the tuple element between them."""
    entry = module.entry
    operand = entry.by_name[entry.by_name[name].operands[0]]
    while operand.opcode in ("bitcast", "copy", "reshape"):
        operand = entry.by_name[operand.operands[0]]
    assert operand.opcode == "get-tuple-element", operand.line
    loop = entry.by_name[operand.operands[0]]
    assert loop.opcode == "while", loop.line
    return ht.call_graph(module).loop(entry, loop)


def test_tagged_has_one_gradient_all_reduce_outside_both_loops(cpu_tagged, programs):
    p = programs
    records = ht.collectives(cpu_tagged)
    assert len(records) == len(_all_reduce_lines(cpu_tagged)) == 1
    (c,) = records
    assert c.kind == "all-reduce"
    assert c.loops == ()
    assert c.shape == (p.LAYERS, p.WIDTH, p.WIDTH)
    assert c.elements == p.LAYERS * p.WIDTH * p.WIDTH
    assert c.bytes == 4 * c.elements
    assert c.group_size == 8 and c.multiplier == 1
    # What it reduces and where it goes, not its op_name (JAX 0.10.2 names it after
    # the reshard, 0.12.1 after the reduce_sum its unreduced-to-replicated reshard
    # lowers to): the gradient the microbatch loop accumulated, output as the step's
    # result.
    module = ht.parse(cpu_tagged)
    assert c.computation == module.entry.name
    assert _loop_result_reduced(module, c.name).trip_count == p.MICROBATCHES
    assert ht.reaches_root(module, c.computation, c.name, target=c.computation)
    outside = ht.assert_reduced_once_per_step(cpu_tagged)
    assert [o.name for o in outside] == [c.name]


def test_tagged_program_still_has_both_loops(cpu_tagged, programs):
    # The collective is outside loops that do exist: the microbatch loop with the
    # layer loops (forward and backward) nested inside it.
    module = ht.parse(cpu_tagged)
    whiles = [i for i in module.instructions() if i.opcode == "while"]
    trips = sorted(
        ht.call_graph(module).loop(module.computations[w.computation], w).trip_count for w in whiles
    )
    assert trips == sorted([programs.MICROBATCHES, programs.LAYERS, programs.LAYERS])


def test_replicated_reduces_inside_nested_loops(cpu_replicated, programs):
    p = programs
    records = ht.collectives(cpu_replicated)
    assert len(records) == len(_all_reduce_lines(cpu_replicated)) == 1
    (c,) = records
    assert [lp.trip_count for lp in c.loops] == [p.MICROBATCHES, p.LAYERS]
    assert all(lp.trip_count_source == "known" for lp in c.loops)
    assert c.multiplier == p.LAYERS * p.MICROBATCHES
    assert c.shape == (p.WIDTH, p.WIDTH)
    assert c.bytes_per_step == p.LAYERS * p.MICROBATCHES * p.WIDTH * p.WIDTH * 4


def test_replicated_fails_the_assertion_with_a_findable_message(cpu_replicated, programs):
    with pytest.raises(AssertionError) as err:
        ht.assert_reduced_once_per_step(cpu_replicated)
    message = str(err.value)
    (c,) = ht.collectives(cpu_replicated)
    assert c.op_name in message
    assert f"f32[{programs.WIDTH},{programs.WIDTH}]" in message
    assert c.loop_path in message and f"x{c.multiplier}/step" in message
    # A threshold above the per-layer gradient size lets it through the loop
    # check; nothing gradient-sized is left outside, so the vacuity guard fires.
    with pytest.raises(AssertionError, match="vacuous"):
        ht.assert_reduced_once_per_step(cpu_replicated, max_in_loop_elements=c.elements)


def test_traffic_weights_by_trip_counts(cpu_tagged, cpu_replicated, programs):
    p = programs
    grad_bytes = p.LAYERS * p.WIDTH * p.WIDTH * 4
    tagged = ht.traffic(cpu_tagged)
    assert tagged["in_loop"] == {}
    assert tagged["outside"]["all-reduce"]["bytes_per_step"] == grad_bytes
    replicated = ht.traffic(ht.parse(cpu_replicated))
    row = replicated["in_loop"]["all-reduce"]
    assert row["executions"] == p.LAYERS * p.MICROBATCHES
    # Every layer's gradient is reduced once per microbatch: M x the tagged traffic.
    assert replicated["bytes_per_step"] == p.MICROBATCHES * grad_bytes
    assert replicated["exact"] and tagged["exact"]


def test_split_by_entry_loop(cpu_tagged, cpu_replicated, programs):
    inside, outside = ht.split_by_entry_loop(cpu_tagged)
    assert ht.cross_replica_all_reduce_sizes(inside) == []
    assert ht.cross_replica_all_reduce_sizes(outside) == [programs.LAYERS * programs.WIDTH**2]
    inside, outside = ht.split_by_entry_loop(cpu_replicated)
    assert ht.cross_replica_all_reduce_sizes(inside) == [programs.WIDTH**2]
    assert ht.cross_replica_all_reduce_sizes(outside) == []
    # Every instruction line lands on exactly one side.
    n = sum(1 for _ in ht.parse(cpu_replicated).instructions())
    assert len(inside) + len(outside) == n


def test_jitted_helpers(programs):
    import jax

    mesh = programs.cpu_mesh()
    with jax.set_mesh(mesh):
        args = programs.cpu_args(mesh)
        text = ht.compiled_text(programs.make_step(True), *args)
        assert ht.collectives(text)[0].kind == "all-reduce"
        ht.assert_jitted_reduced_once_per_step(programs.make_step(True), *args)
        with pytest.raises(AssertionError, match="inside a loop"):
            ht.assert_jitted_reduced_once_per_step(programs.make_step(False), *args)
        assert (
            ht.report_jitted(programs.make_step(False), *args).splitlines()[-1].startswith("FAIL")
        )


def test_vacuity_guard_on_a_program_without_reductions():
    import jax.numpy as jnp

    text = ht.compiled_text(lambda x: jnp.tanh(x) * 2, jnp.ones((8, 8)))
    assert ht.collectives(text) == []
    with pytest.raises(AssertionError, match="vacuous"):
        ht.assert_reduced_once_per_step(text)
