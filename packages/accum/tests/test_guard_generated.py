"""Seeded random models: the compiled verdict against an oracle of its own, and
accumulated against full-batch gradients (tests/guard_generator.py).

25 programs here (every variant and mesh among them: the coverage test below), 525
more in the slow tier; a failing seed prints the command that replays it alone.
"""

from __future__ import annotations

import functools

import pytest

# 25 in the cpu tier (each a compile and run, in the cpu tier and again on the newest
# JAX in wheels_newest); the rest in the slow tier.
CPU_SEEDS = range(25)
SLOW_SEEDS = range(25, 550)
RTOL = 1e-4  # f32 sums in another order (full batch vs microbatches)


@functools.cache
def _outcome(gg, seed: int):
    return gg.run(seed)


def _judge(gg, seed: int) -> None:
    outcome = _outcome(gg, seed)
    where = f"{gg.program(seed).describe()}\nreplay: {gg.replay_command(seed)}"
    assert outcome.verdict == outcome.oracle, (
        f"compiled verdict {outcome.verdict}, oracle {outcome.oracle}: {where}\n{outcome.message}"
    )
    assert outcome.max_rel_error < RTOL, (
        f"accumulated vs full-batch gradients differ by {outcome.max_rel_error:.2e}: {where}"
    )


@pytest.mark.parametrize("seed", CPU_SEEDS)
def test_generated_program(generator, seed):
    _judge(generator, seed)


@pytest.mark.slow
@pytest.mark.parametrize("seed", SLOW_SEEDS)
def test_generated_program_slow(generator, seed):
    _judge(generator, seed)


def test_the_cpu_programs_cover_every_variant_and_mesh_and_reduce_in_a_fair_share(generator):
    """Every accumulation variant and mesh (FSDP included) is drawn, and between a
    quarter and three quarters of the programs truly reduce a deferred axis in
    the loop, on the FSDP mesh too."""
    gg = generator
    programs = [gg.program(seed) for seed in CPU_SEEDS]
    assert {p.variant for p in programs} == {"plain", "fused", "zero1", "add", "hierarchical"}
    assert {p.mesh_name for p in programs} == set(gg.MESHES)
    reducing = sum(_outcome(gg, seed).oracle for seed in CPU_SEEDS)
    assert len(CPU_SEEDS) // 4 <= reducing <= 3 * len(CPU_SEEDS) // 4, reducing
    fsdp = [p.seed for p in programs if p.mesh_name == "data2_fsdp4"]
    fsdp_reducing = sum(_outcome(gg, seed).oracle for seed in fsdp)
    assert 0 < fsdp_reducing < len(fsdp), (fsdp_reducing, fsdp)
