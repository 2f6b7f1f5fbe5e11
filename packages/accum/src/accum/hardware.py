"""Per-chip figures the cost model (accum/cost.py) needs, for the chips tagtrain targets.

Each entry: peak dense bf16 FLOP/s, HBM bytes, and the per-chip bandwidth of the
two links a gradient reduction can cross: ICI (inside a slice / NVLink domain)
and DCN (between slices / nodes), both in bytes per second in one direction.
Where each figure comes from is in docs/cost_model.md ("Hardware table");
a figure no public page states is None, and `hardware()` refuses to model with it.
"""

from __future__ import annotations

import dataclasses

GIB = 1024**3
GB_PER_S = 1e9  # bytes per second
GBIT_PER_S = 1e9 / 8


class HardwareError(ValueError):
    """An unknown chip, or a table entry missing a figure the model needs."""


@dataclasses.dataclass(frozen=True)
class Hardware:
    """One chip's figures; None marks a figure no public source gave us."""

    name: str
    peak_flops: float | None  # dense bf16 FLOP/s per chip
    hbm_bytes: int | None  # per chip
    ici_bytes_per_s: float | None  # per chip, one direction, all ICI links together
    dcn_bytes_per_s: float | None  # per chip, one direction (host NICs / chips per host)

    def missing(self) -> list[str]:
        """The names of the figures that are None."""
        return [f.name for f in dataclasses.fields(self) if getattr(self, f.name) is None]


# Each figure's public source and the arithmetic behind it: docs/cost_model.md,
# "Hardware table" (GPU DCN: one 400 Gb/s ConnectX-7 per GPU, NVIDIA's DGX H100/H200).
HARDWARE = {
    # ICI: the v4 page's all-reduce bandwidth per pod over its 4096 chips; DCN: the
    # scaling book's typical 2.5e10 B/s per host over a v4 host's 4 chips.
    "v4": Hardware("v4", 275e12, 32 * GIB, 1.1e15 / 4096, 2.5e10 / 4),
    "v5e": Hardware("v5e", 197e12, 16 * GIB, 400 / 2 * GB_PER_S, 2 * 100 / 8 * GBIT_PER_S),
    "v5p": Hardware("v5p", 459e12, 95 * GIB, 1200 / 2 * GB_PER_S, 50 * GBIT_PER_S),
    "v6e": Hardware("v6e", 918e12, 32 * GIB, 800 / 2 * GB_PER_S, 4 * 200 / 8 * GBIT_PER_S),
    "h100": Hardware("h100", 989e12, 80 * 10**9, 900 / 2 * GB_PER_S, 400 * GBIT_PER_S),
    "h200": Hardware("h200", 989e12, 141 * 10**9, 900 / 2 * GB_PER_S, 400 * GBIT_PER_S),
}


def hardware(name: str, table: dict[str, Hardware] | None = None) -> Hardware:
    """The complete entry for `name` (a chip like "v5p", or a topology like "v5p-16").

    Raises HardwareError naming the chip (unknown: the known ones; incomplete:
    the missing figures, to be added to the table) before anything is modelled.
    """
    table = HARDWARE if table is None else table
    chip = name.split("-")[0].lower()
    entry = table.get(chip)
    if entry is None:
        raise HardwareError(
            f"no hardware table entry for {name!r}; known: {', '.join(table)} "
            "(add one to accum.hardware.HARDWARE)"
        )
    missing = entry.missing()
    if missing:
        raise HardwareError(
            f"hardware table entry {entry.name!r} lacks {', '.join(missing)} (no public "
            f"source found): add the figure to accum.hardware.HARDWARE[{entry.name!r}] "
            "or model another chip"
        )
    return entry
