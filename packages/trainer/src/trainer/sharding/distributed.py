"""Multi-host start-up: `jax.distributed.initialize` from flags or the environment.

Sources, first match wins:

1. flags `--coordinator_address=HOST:PORT --num_processes=N --process_id=I`;
2. environment `JAX_COORDINATOR_ADDRESS` with `JAX_NUM_PROCESSES` and `JAX_PROCESS_ID`;
3. a cluster JAX detects by itself (Cloud TPU pod slices and multislice, SLURM,
   Open MPI, GKE): initialize() is called without arguments when one of them
   reports more than one process.

A single process (none of the above) never calls initialize. On CPU the
cross-process collectives go through gloo.
"""

from __future__ import annotations

import dataclasses
import os


@dataclasses.dataclass(frozen=True)
class Launch:
    coordinator_address: str | None
    num_processes: int | None
    process_id: int | None
    source: str  # "flags", "environment", "cluster" or "single"

    @property
    def multi_process(self) -> bool:
        return self.source != "single"


def _int_env(name: str) -> int | None:
    value = os.environ.get(name)
    if value is None or value == "":
        return None
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"environment variable {name}={value!r} is not an integer") from None


def _cluster_detected() -> bool:
    """A scheduler that launched more than one process (JAX reads the details itself)."""
    for name in ("SLURM_NTASKS", "OMPI_COMM_WORLD_SIZE"):
        if (_int_env(name) or 1) > 1:
            return True
    hosts = os.environ.get("TPU_WORKER_HOSTNAMES", "")
    return (
        len([h for h in hosts.split(",") if h]) > 1 or (_int_env("MEGASCALE_NUM_SLICES") or 1) > 1
    )


def choose_launch(
    coordinator_address: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
    skip: bool = False,
) -> Launch:
    """Where the process group comes from; ValueError naming the flag when incomplete.

    `skip` (skip_jax_distributed_system): one process, whatever the environment says.
    """
    given = {
        "--coordinator_address": coordinator_address,
        "--num_processes": num_processes,
        "--process_id": process_id,
    }
    if skip:
        named = [k for k, v in given.items() if v is not None]
        if named:
            raise ValueError(
                f"skip_jax_distributed_system=true contradicts {', '.join(named)}: drop one"
            )
        return Launch(None, None, None, "single")
    if any(v is not None for v in given.values()):
        missing = [k for k, v in given.items() if v is None]
        if missing:
            raise ValueError(f"multi-process flags need all three; missing {', '.join(missing)}")
        if num_processes < 1 or not 0 <= process_id < num_processes:
            raise ValueError(
                f"--process_id={process_id} must be in [0, --num_processes={num_processes})"
            )
        return Launch(coordinator_address, num_processes, process_id, "flags")
    address = os.environ.get("JAX_COORDINATOR_ADDRESS")
    if address:
        return Launch(
            address, _int_env("JAX_NUM_PROCESSES"), _int_env("JAX_PROCESS_ID"), "environment"
        )
    if _cluster_detected():
        return Launch(None, None, None, "cluster")
    return Launch(None, None, None, "single")


def initialize(launch: Launch) -> None:
    """Join the process group (before any JAX backend is used); no-op for one process."""
    if not launch.multi_process:
        return
    import jax

    # Only shapes the CPU backend: cross-process collectives between CPU devices.
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(
        coordinator_address=launch.coordinator_address,
        num_processes=launch.num_processes,
        process_id=launch.process_id,
    )


def describe() -> str:
    """`processes: 2 (this is 0), 8 devices, 4 local` — after initialize."""
    import jax

    return (
        f"processes: {jax.process_count()} (this is {jax.process_index()}), "
        f"{jax.device_count()} devices, {jax.local_device_count()} local"
    )
