"""Collective bytes that cross slices vs stay inside one.

Two program shapes. A multi-slice TPU compile is one slice's program: its
collectives stay in the slice and the cross-slice ones are megascale (DCN)
sends (`Collective.cross_slice`). A single program over emulated slices (CPU)
has the cross-slice (DCN) mesh axes outermost, so the logical device ids of one
slice form a contiguous block: slice s holds ids [s * n, (s + 1) * n) with
n = devices / slices, and a collective crosses slices when one of its replica
groups holds devices of two slices. A mesh axis with a cross-slice part that is
not outermost (the trainer's 'expert' axis over several slices) breaks the
blocks: `slice_of` then gives each logical device id's slice.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from hlo_tools.collectives import Collective, collectives
from hlo_tools.module import HloModule
from hlo_tools.parser import parse
from hlo_tools.report import human_bytes


def crosses_slices(
    collective: Collective,
    num_devices: int,
    num_slices: int,
    slice_of: Sequence[int] | None = None,
) -> bool:
    """Whether some replica group joins devices of different slices.

    No replica groups means every device (all slices). A collective-permute
    carries pairs, not groups, and is counted as crossing (an upper bound).
    `slice_of`: the slice of each logical device id (default: contiguous blocks).
    """
    if collective.cross_slice:
        return True
    if num_slices <= 1:
        return False
    per_slice = num_devices // num_slices
    if collective.kind == "collective-permute":
        return True
    groups = collective.replica_groups or (tuple(range(num_devices)),)
    where = slice_of or [d // per_slice for d in range(num_devices)]
    return any(len({where[d] for d in group}) > 1 for group in groups)


def split_by_slice(
    records: Iterable[Collective],
    num_slices: int,
    num_devices: int,
    slice_of: Sequence[int] | None = None,
) -> tuple[list[Collective], list[Collective]]:
    """(records that cross slices, records that stay in one).

    In one slice's program (it holds megascale transfers) only those cross;
    otherwise the replica groups decide (`crosses_slices`, `slice_of` as there).
    """
    records = list(records)
    if any(c.cross_slice for c in records):
        num_slices = 1  # one slice's program: its device ids are one slice's
    cross = [c for c in records if crosses_slices(c, num_devices, num_slices, slice_of)]
    return cross, [c for c in records if c not in cross]


def slice_traffic(
    module: HloModule | str | Iterable[Collective],
    num_slices: int,
    num_devices: int | None = None,
    slice_of: Sequence[int] | None = None,
) -> dict:
    """Bytes per step (trip-count weighted) split by where the collective runs
    (`slice_of`: as in `crosses_slices`).

    Returns ``{"cross_slice": {"in_loop": b, "outside": b}, "in_slice": {...},
    "exact": bool}``; `exact` is False when a loop's trip count is unknown (each
    such collective counted once: a lower bound).
    """
    if isinstance(module, str):
        module = parse(module)
    if isinstance(module, HloModule):
        num_devices = num_devices or module.num_devices
        records = collectives(module)
    else:
        records = list(module)
    if num_devices is None:
        raise ValueError("slice_traffic needs num_devices for collective records")
    out: dict = {"exact": True}
    cross, inside = split_by_slice(records, num_slices, num_devices, slice_of)
    for side, group in (("cross_slice", cross), ("in_slice", inside)):
        out[side] = {"in_loop": 0, "outside": 0}
        for c in group:
            times = c.multiplier
            if times is None:
                out["exact"], times = False, 1
            out[side]["in_loop" if c.in_loop else "outside"] += c.bytes * times
    return out


def format_slice_traffic(split: dict) -> str:
    """``cross-slice 1.2 MiB/step (0 B in loops), in-slice 3.4 MiB/step (2.0 MiB in loops)``."""
    mark = "" if split["exact"] else "+"
    parts = []
    for side, name in (("cross_slice", "cross-slice"), ("in_slice", "in-slice")):
        row = split[side]
        total = row["in_loop"] + row["outside"]
        parts.append(
            f"{name} {human_bytes(total)}{mark}/step ({human_bytes(row['in_loop'])} in loops)"
        )
    return ", ".join(parts)
