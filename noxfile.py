"""Test tiers for tagtrain. Every session runs in the locked uv environment.

uv run nox -s lint cpu aot     # what CI runs
uv run nox -s slow             # longer CPU tests
uv run nox -s tpu_integration  # real chips; skips below 4 devices
uv run nox -s bench            # writes benchmarks/results/
"""

import os

import nox

nox.options.default_venv_backend = "uv"
nox.options.reuse_existing_virtualenvs = True
nox.options.sessions = ["lint", "cpu", "aot"]

# Two pytest workers (the CI machine has 2 cores; the tests are compile-bound and
# JAX compiles on one thread). `loadfile` keeps a file's tests, and the compiled
# runs their fixtures cache, on one worker.
PARALLEL = ["-n", "2", "--dist", "loadfile"]

# On a CPU host the tests simulate a mesh of 8 devices; JAX_PLATFORMS=cpu keeps
# libtpu (installed by the `tpu` extra) from probing for chips that are not there.
CPU_ENV = {"JAX_PLATFORMS": "cpu"}


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
        "-m",
        "not aot and not integration and not slow",
        *session.posargs,
        env=CPU_ENV,
    )


@nox.session
def slow(session: nox.Session) -> None:
    """CPU tests marked slow (multi-process runs, longer trainings)."""
    _sync(session)
    session.run(
        "pytest", "-m", "slow and not aot and not integration", *session.posargs, env=CPU_ENV
    )


@nox.session
def aot(session: nox.Session) -> None:
    """Compiles for TPU topologies on this CPU host (libtpu from the `tpu` extra)."""
    _sync(session, "tpu")
    # The full AOT matrix is also marked slow: `-s slow_aot` (or pytest -m "aot and slow").
    session.run("pytest", "-m", "aot and not slow", *session.posargs, env=CPU_ENV)


@nox.session
def slow_aot(session: nox.Session) -> None:
    """The slow AOT tests: the whole parallelism matrix on v5e-8 and v5p-16."""
    _sync(session, "tpu")
    session.run("pytest", "-m", "aot and slow", *session.posargs, env=CPU_ENV)


@nox.session
def tpu_integration(session: nox.Session) -> None:
    """Real accelerators (TPU or GPU); every test skips with fewer than 4 devices."""
    _sync(session, "tpu")
    session.run("pytest", "-m", "integration", *session.posargs)


@nox.session
def bench(session: nox.Session) -> None:
    """Benchmark scripts; results land under benchmarks/results/."""
    _sync(session, "tpu")  # the AOT benches compile for TPU topologies
    os.makedirs("benchmarks/results", exist_ok=True)
    scripts = sorted(
        f for f in os.listdir("benchmarks") if f.startswith("bench_") and f.endswith(".py")
    )
    if session.posargs:
        scripts = [s for s in scripts if any(a in s for a in session.posargs)]
    for script in scripts:
        session.run("python", os.path.join("benchmarks", script), env=CPU_ENV)
