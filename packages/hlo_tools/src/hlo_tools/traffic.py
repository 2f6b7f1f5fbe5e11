"""Collective bytes per step, by kind, inside vs outside while loops."""

from __future__ import annotations

from collections.abc import Iterable

from hlo_tools.collectives import Collective, collectives
from hlo_tools.module import HloModule


def traffic(module: HloModule | str | Iterable[Collective]) -> dict:
    """Bytes per step by collective kind, split into ``in_loop`` and ``outside``.

    Accepts HLO text, a parsed module, or collective records (e.g. filtered ones).
    Returns::

        {"in_loop": {kind: row}, "outside": {kind: row},
         "bytes_per_step": int, "exact": bool}

    where each row is ``{"count", "executions", "bytes_per_execution",
    "bytes_per_step", "unknown_trip_count"}``. ``bytes_per_execution`` sums
    each collective once; ``bytes_per_step`` weights it by the product of its
    loops' trip counts. A collective under a loop of unknown trip count is
    counted once in ``bytes_per_step`` and in ``unknown_trip_count``, and
    ``exact`` turns False: the totals are then lower bounds.

    >>> t = ht.traffic(HLO)
    >>> t["in_loop"]["all-reduce"]["bytes_per_step"], t["bytes_per_step"], t["exact"]
    (4096, 5120, True)
    """
    records = module if isinstance(module, list | tuple) else collectives(module)
    out: dict = {"in_loop": {}, "outside": {}, "bytes_per_step": 0, "exact": True}
    for c in records:
        side = out["in_loop" if c.in_loop else "outside"]
        row = side.setdefault(
            c.kind,
            {
                "count": 0,
                "executions": 0,
                "bytes_per_execution": 0,
                "bytes_per_step": 0,
                "unknown_trip_count": 0,
            },
        )
        multiplier = c.multiplier
        if multiplier is None:
            row["unknown_trip_count"] += 1
            out["exact"] = False
            multiplier = 1
        row["count"] += 1
        row["executions"] += multiplier
        row["bytes_per_execution"] += c.bytes
        row["bytes_per_step"] += c.bytes * multiplier
        out["bytes_per_step"] += c.bytes * multiplier
    return out
