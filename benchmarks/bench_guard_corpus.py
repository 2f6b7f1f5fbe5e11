"""The generated corpus: compiled verdict, trace-time analysis and gradients per program.

Runs the seeded random models of packages/accum/tests/guard_generator.py
(seeds 0..N-1; N from the first argument, default 100) and, for each, compares
against the HLO oracle (in-loop reductions over the watched axis, counted by
the test's own text parsing):

- the compiled verdict (`accum.compile_checked`): raised iff the oracle counts one;
- the trace-time analysis alone (the step traced in a plain `jax.jit`): a false
  alarm is a warning on a program the oracle clears, a miss no warning on one
  it does not;
- the accumulated gradients against the full-batch ones (max relative error).

Writes benchmarks/results/guard_corpus.md and .csv:

    JAX_PLATFORMS=cpu XLA_FLAGS=--xla_backend_optimization_level=0 \\
        uv run python benchmarks/bench_guard_corpus.py 100
"""

from __future__ import annotations

import importlib.util
import os
import sys

import jax

jax.config.update("jax_num_cpu_devices", 8)

import benchlib as bl  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
GENERATOR = os.path.join(HERE, "..", "packages", "accum", "tests", "guard_generator.py")
COMMAND = (
    "JAX_PLATFORMS=cpu XLA_FLAGS=--xla_backend_optimization_level=0 "
    "uv run python benchmarks/bench_guard_corpus.py"
)
RTOL = 1e-4


def _generator():
    spec = importlib.util.spec_from_file_location("guard_generator", GENERATOR)
    module = importlib.util.module_from_spec(spec)
    # Registered first: dataclasses resolve string annotations through sys.modules.
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def main() -> int:
    count = int(sys.argv[1]) if len(sys.argv) > 1 else 100
    gg = _generator()
    rows = []
    for seed in range(count):
        prog = gg.program(seed)
        outcome = gg.run(seed, trace_time=True)
        rows.append(
            {
                "seed": seed,
                "mesh": prog.mesh_name,
                "variant": prog.variant,
                "embed": prog.embed,
                "body": " ".join(prog.body),
                "loss": prog.loss,
                "penalty": prog.penalty,
                "oracle": outcome.oracle,
                "compiled_verdict": outcome.verdict,
                "trace_time_warned": outcome.trace_time,
                "max_rel_error": f"{outcome.max_rel_error:.1e}",
            }
        )
        print(rows[-1], flush=True)

    def seeds(pred):
        return [r["seed"] for r in rows if pred(r)]

    verdict_wrong = seeds(lambda r: r["compiled_verdict"] != r["oracle"])
    false_alarms = seeds(lambda r: r["trace_time_warned"] and not r["oracle"])
    misses = seeds(lambda r: r["oracle"] and not r["trace_time_warned"])
    gradients = seeds(lambda r: float(r["max_rel_error"]) >= RTOL)
    reducing = sum(r["oracle"] for r in rows)
    summary = [
        ("programs", count),
        ("truly reduce a deferred axis in the loop (oracle)", reducing),
        ("compiled verdict disagrees with the oracle", _listed(verdict_wrong)),
        ("trace-time analysis: false alarms (warns, oracle clears)", _listed(false_alarms)),
        ("trace-time analysis: misses (silent, oracle counts one)", _listed(misses)),
        (f"accumulated vs full-batch gradients off by >= {RTOL:g} (relative)", _listed(gradients)),
    ]
    by_variant, by_mesh = {}, {}
    for r in rows:
        for table, key in ((by_variant, r["variant"]), (by_mesh, r["mesh"])):
            table.setdefault(key, [0, 0])
            table[key][0] += 1
            table[key][1] += r["oracle"]
    lines = bl.header(
        f"Generated corpus: {count} random models",
        f"{COMMAND} {count}",
        [
            "models: packages/accum/tests/guard_generator.py (seed -> program; the cpu tier "
            "runs seeds 0-24, the slow tier 25-549)",
            "oracle: all-reduce/reduce-scatter made by the backward pass (op_name with "
            "transpose(, not a remat recomputation: a forward psum is the model's own) with an "
            "array > 8 elements spanning the watched axis inside the ENTRY while loop of "
            "trip count 2 (the whole program for accum.add), "
            "read from the HLO text by the generator's own regular expressions; the watched axis "
            "is the mesh's deferred one ('dcn' for hierarchical), none when a weight is sharded "
            "over it at rest (it reduces that axis per use by design)",
            "trace-time analysis: the same step traced in a plain jax.jit "
            "(accum's find_dropped_tags + gradient types), which can only warn",
        ],
    )
    lines += bl.table(["", "count (seeds)"], summary, align="lr")
    lines += ["", "Programs and truly reducing ones, per accumulation variant:", ""]
    lines += bl.table(
        ["variant", "programs", "truly reduce"],
        [(v, n, k) for v, (n, k) in sorted(by_variant.items())],
    )
    lines += ["", "Per mesh (data2_fsdp4: weights at rest over 'fsdp', gathered per use):", ""]
    lines += bl.table(
        ["mesh", "programs", "truly reduce"],
        [(m, n, k) for m, (n, k) in sorted(by_mesh.items())],
    )
    bl.write("guard_corpus", lines, rows)
    return 0


def _listed(seeds: list[int]) -> str:
    if not seeds:
        return "0"
    shown = ", ".join(map(str, seeds[:30]))
    return f"{len(seeds)} ({shown}{', ...' if len(seeds) > 30 else ''})"


if __name__ == "__main__":
    raise SystemExit(main())
