"""Test tiers for tagtrain. Every session but the two wheel sessions runs in the locked
uv environment.

uv run nox -s lint cpu aot device_check wheels_newest  # what CI runs
uv run nox -s wheels_minimum   # the wheels at the declared minimum versions (Python 3.11)
uv run nox -s slow             # longer CPU tests
uv run nox -s tpu_integration  # real chips; skips below 4 devices
uv run nox -s bench            # writes benchmarks/results/
"""

import os
import re
import tomllib
from pathlib import Path

import nox
from packaging.requirements import Requirement

# The CPU preset the wheel sessions train for two steps (one place to rename it).
TRAIN_PRESET = "tagtrain-tiny"

nox.options.default_venv_backend = "uv"
nox.options.reuse_existing_virtualenvs = True
# A wheel session whose Python (3.12, 3.11) is missing fails instead of skipping.
nox.options.error_on_missing_interpreters = True
nox.options.sessions = ["lint", "cpu", "aot", "device_check", "wheels_newest"]

# Two pytest workers (the CI machine has 2 cores; the tests are compile-bound and
# JAX compiles on one thread). `loadfile` keeps a file's tests, and the compiled
# runs their fixtures cache, on one worker.
PARALLEL = ["-n", "2", "--dist", "loadfile"]
# The slowest tests of a tier, printed at its end, so CI's log says where its minutes go.
DURATIONS = ["--durations=15"]

# Python keeps the bytecode of what it imports (__pycache__) even where the machine
# sets PYTHONDONTWRITEBYTECODE (CI's does; an empty value unsets it): the tests start
# dozens of Python processes (two pytest workers, `train`, `hlo-report`, the README's
# and docs' commands), and without it each compiled every module it imports (jax,
# flax, orbax, the packages) from source again, 3-7 s of CPU a process.
BYTECODE_ENV = {"PYTHONDONTWRITEBYTECODE": ""}
# On a CPU host the tests simulate a mesh of 8 devices; JAX_PLATFORMS=cpu keeps
# libtpu (installed by the `tpu` extra) from probing for chips that are not there.
CPU_ENV = {"JAX_PLATFORMS": "cpu", **BYTECODE_ENV}
# libtpu lets one process at a time load it (its lockfile); compiling for a topology
# touches no chip, so the aot tier's two workers may both load it.
AOT_ENV = {**CPU_ENV, "ALLOW_MULTIPLE_LIBTPU_LOAD": "1"}

# The cpu and slow tiers compile far more than they run (a few tiny steps per
# compile), and most of a compile is LLVM optimising the CPU kernels: unoptimised
# (-O0), a trainer step compiles in under half the CPU time. What the tests check is
# decided before LLVM: the compiled HLO text (collectives, loops), buffer assignment
# and memory_analysis come out identical (the ZeRO-1 GA=4 step: the same sha256 of
# as_text()); numbers move by float rounding (grad norm ~1e-7 relative), far inside
# every tolerance, and runs compared bitwise are runs of one build. Appended to
# XLA_FLAGS, so a flag set by hand still applies. device_check's subprocesses and the
# wheel sessions' unit tests use it too (the same tests and assertions; on CI's 2
# cores the wheels' tests and device_check took 10 and 3.5 minutes at -O3); `aot` and
# `bench` keep XLA's defaults, and so does the wheels' 2-step `train`, which compiles
# the installed trainer as a user's run does.
CPU_TEST_ENV = {
    **CPU_ENV,
    "XLA_FLAGS": f"{os.environ.get('XLA_FLAGS', '')} --xla_backend_optimization_level=0".strip(),
}
# The sessions on the locked jaxlib also generate XLA:CPU's fused kernels with its
# elemental emitter instead of the MLIR fusion emitters, about half of XLA's compile
# of a trainer step at -O0. XLA then forms a few fusions differently (the text inside
# fusions differs); the collectives, loops and numbers the tests read do not, and
# every test passes either way. The wheel sessions keep the default emitters: their
# unit tests check the same assertions on XLA's usual programs, and a newer jaxlib
# that dropped this flag would abort on it.
LOCKED_CPU_TEST_ENV = {
    **CPU_TEST_ENV,
    "XLA_FLAGS": f"{CPU_TEST_ENV['XLA_FLAGS']} --xla_cpu_use_fusion_emitters=false",
}


def _sync(session: nox.Session, *extras: str) -> None:
    """Install exactly what uv.lock pins into this session's virtualenv."""
    args = ["uv", "sync", "--locked", "--all-packages", "--group", "dev"]
    for extra in extras:
        args += ["--extra", extra]
    session.run_install(*args, env={"UV_PROJECT_ENVIRONMENT": session.virtualenv.location})


@nox.session
def lint(session: nox.Session) -> None:
    """One formatter and one linter (ruff) over the whole tree."""
    _sync(session)
    session.run("ruff", "format", "--check", ".")
    session.run("ruff", "check", ".")


@nox.session
def cpu(session: nox.Session) -> None:
    """Every package's unit tests on 8 virtual CPU devices."""
    _sync(session)
    session.run(
        "pytest",
        *PARALLEL,
        *DURATIONS,
        "-m",
        "not aot and not integration and not slow",
        # The device_check session runs this file whole.
        "--ignore=tests/test_device_check.py",
        *session.posargs,
        env=LOCKED_CPU_TEST_ENV,
    )


@nox.session
def slow(session: nox.Session) -> None:
    """CPU tests marked slow (multi-process runs, longer trainings, the full matrices)."""
    _sync(session)
    session.run(
        "pytest",
        *PARALLEL,
        "-m",
        "slow and not aot and not integration",
        *session.posargs,
        env=LOCKED_CPU_TEST_ENV,
    )


@nox.session
def aot(session: nox.Session) -> None:
    """Compiles for TPU and GPU topologies on this CPU host (libtpu from the `tpu`
    extra, jax's CUDA plugin and ptxas from the `gpu` extra)."""
    _sync(session, "tpu", "gpu")
    # The full AOT matrix is also marked slow: `-s slow_aot` (or pytest -m "aot and slow").
    session.run(
        "pytest", *PARALLEL, *DURATIONS, "-m", "aot and not slow", *session.posargs, env=AOT_ENV
    )


@nox.session
def device_check(session: nox.Session) -> None:
    """benchmarks/device_check.sh run on CPU (its small shape), so CI keeps the GPU
    host's script working: tests/test_device_check.py, its slow run included."""
    _sync(session)
    session.run("pytest", "tests/test_device_check.py", *session.posargs, env=LOCKED_CPU_TEST_ENV)


@nox.session
def slow_aot(session: nox.Session) -> None:
    """The slow AOT tests: the whole parallelism matrix on v5e-8 and v5p-16,
    DeepSeek-V3's full shape on v5p-1024, the longest GPU compiles."""
    _sync(session, "tpu", "gpu")
    session.run("pytest", *PARALLEL, "-m", "aot and slow", *session.posargs, env=AOT_ENV)


@nox.session
def tpu_integration(session: nox.Session) -> None:
    """Real accelerators (TPU or GPU); every test skips with fewer than 4 devices."""
    _sync(session, "tpu")
    session.run("pytest", "-m", "integration", *session.posargs)


@nox.session
def bench(session: nox.Session) -> None:
    """Benchmark scripts; results land under benchmarks/results/."""
    _sync(session, "tpu", "gpu")  # the AOT benches compile for TPU and GPU topologies
    os.makedirs("benchmarks/results", exist_ok=True)
    scripts = sorted(
        f for f in os.listdir("benchmarks") if f.startswith("bench_") and f.endswith(".py")
    )
    if session.posargs:
        scripts = [s for s in scripts if any(a in s for a in session.posargs)]
    for script in scripts:
        session.run("python", os.path.join("benchmarks", script), env=CPU_ENV)


# The five wheels, built from the workspace, and the small packages whose tests run
# against the installed wheels (the trainer gets a two-step `train` instead).
ROOT = Path(__file__).parent
WHEELS = ["pspec-tags", "hlo-tools", "accum", "moe-kernels", "tagtrain"]
SMALL_PACKAGES = ["pspec_tags", "hlo_tools", "accum", "moe_kernels"]
# The trainer tests that exercise the dependencies the 2-step train does not import
# (orbax-checkpoint, grain, tokenizers, pyarrow, matplotlib): run at the declared minimums.
TRAINER_DEPENDENCY_TESTS = tuple(
    f"packages/trainer/tests/test_{name}.py"
    for name in ("checkpoint", "text_data", "hf_data", "outputs")
)
UNIT_TESTS = "not aot and not integration and not slow"


def declared_minimums() -> dict[str, str]:
    """{distribution: version} from every `name>=version` in the packages' pyproject files.

    A dependency declared with different floors by two packages is an error: the
    minimum session could not test both.
    """
    floors: dict[str, str] = {}
    for pyproject in sorted(ROOT.glob("packages/*/pyproject.toml")):
        for line in tomllib.loads(pyproject.read_text())["project"]["dependencies"]:
            req = Requirement(line)
            name = re.sub(r"[-_.]+", "-", req.name).lower()
            for spec in req.specifier:
                if spec.operator != ">=":
                    continue
                if floors.setdefault(name, spec.version) != spec.version:
                    raise ValueError(
                        f"{name}: floors {floors[name]} and {spec.version} in {pyproject}"
                    )
    return floors


def _wheels_session(
    session: nox.Session, constraints: dict[str, str], extra_tests: tuple[str, ...] = ()
) -> None:
    """Build the five wheels, pip-install them into this fresh venv, test, train 2 steps.

    No uv.lock here: pip resolves the wheels' declared requirements (newest releases,
    or `constraints` pinned with ==), as a user's `pip install` would.
    """
    tmp = Path(session.create_tmp())
    dist = tmp / "dist"
    for old in dist.glob("*.whl"):
        old.unlink()
    for package in WHEELS:
        session.run(
            "uv", "build", "--quiet", "--package", package, "--wheel", "--out-dir", str(dist),
            external=True,
        )  # fmt: skip
    args = [*sorted(map(str, dist.glob("*.whl"))), "pytest", "pytest-xdist"]
    if constraints:
        pins = tmp / "constraints.txt"
        pins.write_text("".join(f"{n}=={v}\n" for n, v in sorted(constraints.items())))
        args += ["--constraint", str(pins)]
    session.install("pip")  # the venv is uv's; pip, not uv, resolves the wheels below
    session.run("python", "-m", "pip", "install", "--quiet", *args)
    session.run("python", "-m", "pip", "list", "--format=freeze")
    # The tests run from this tree, so show (and check) that they import the
    # installed wheels: with --import-mode=importlib nothing puts packages/*/src on
    # sys.path.
    session.run(
        "python",
        "-c",
        "import sys, jax, flax, optax, orbax.checkpoint as ocp, pspec_tags, hlo_tools, accum,"
        " moe_kernels, trainer\n"
        "for m in (pspec_tags, hlo_tools, accum, moe_kernels, trainer):\n"
        "    assert m.__file__.startswith(sys.prefix), m.__file__\n"
        "print('python', sys.version.split()[0], 'jax', jax.__version__, 'flax',"
        " flax.__version__, 'optax', optax.__version__, 'orbax-checkpoint',"
        " ocp.__version__, 'from', pspec_tags.__file__)",
    )
    session.run(
        "pytest",
        *PARALLEL,
        "-p",
        "no:cacheprovider",
        "-m",
        UNIT_TESTS,
        *[f"packages/{p}" for p in SMALL_PACKAGES],
        *extra_tests,
        *session.posargs,
        env=CPU_TEST_ENV,
    )
    with session.chdir(tmp):
        session.run(
            "train",
            f"model_name={TRAIN_PRESET}",
            "steps=2",
            "per_device_batch_size=2",
            "gradient_accumulation_steps=2",
            env=CPU_ENV,
        )


@nox.session(python="3.12", venv_backend="uv", reuse_venv=False)
def wheels_newest(session: nox.Session) -> None:
    """The five wheels on Python 3.12 with the newest releases pip picks (JAX 0.12.x)."""
    _wheels_session(session, {})


@nox.session(python="3.11", venv_backend="uv", reuse_venv=False)
def wheels_minimum(session: nox.Session) -> None:
    """The five wheels on Python 3.11 with every dependency at its declared minimum."""
    _wheels_session(session, declared_minimums(), TRAINER_DEPENDENCY_TESTS)


# torch and transformers for the two Hugging Face sessions only (never a package
# dependency). Installed with pip into a plain virtualenv, so pip's own configuration
# decides where the wheels come from; the fixtures record the transformers version.
HF_TOOLS = ["torch==2.13.0", "transformers==5.24.0", "peft==0.21.2", "safetensors", "numpy"]
HF_FIXTURES = "packages/trainer/tests/fixtures/make_hf_fixtures.py"
HF_PARITY = "packages/trainer/tests/fixtures/hf_parity.py"
PEFT_FIXTURES = "packages/trainer/tests/fixtures/make_peft_fixtures.py"


@nox.session(venv_backend="virtualenv")
def hf_fixtures(session: nox.Session) -> None:
    """Rebuild the tiny HF checkpoints and transformers' reference logits under
    packages/trainer/tests/fixtures/hf/ (commit the result)."""
    session.install(*HF_TOOLS)
    session.run("python", HF_FIXTURES)
    session.run("python", PEFT_FIXTURES)  # over the fixtures just written


@nox.session(venv_backend="virtualenv")
def hf_parity(session: nox.Session) -> None:
    """Export every fixture through trainer.hf (perturbed weights, in the locked uv
    environment), load the exports with transformers and compare logits (1e-4)."""
    session.install(*HF_TOOLS)
    out = Path(session.create_tmp()) / "hf_exports"
    session.run(
        "uv", "run", "--locked", "python", HF_PARITY, "export", str(out), external=True,
        env=CPU_ENV,
    )  # fmt: skip
    session.run("python", HF_PARITY, "compare", str(out))
