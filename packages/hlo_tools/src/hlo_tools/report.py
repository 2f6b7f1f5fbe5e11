"""Human table and JSON for the collectives of a module (what ``hlo-report`` prints)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from hlo_tools.assertions import gradient_reductions_outside, in_loop_reductions
from hlo_tools.collectives import Collective, collectives
from hlo_tools.mesh_axes import spanned_axes, spans_mesh_axis
from hlo_tools.module import HloModule
from hlo_tools.traffic import traffic


def select(
    records: list[Collective], kinds: list[str] | None = None, min_bytes: int = 0
) -> list[Collective]:
    """Records of the given kinds (all when None) moving at least ``min_bytes`` per execution."""
    return [c for c in records if (not kinds or c.kind in kinds) and c.bytes >= min_bytes]


def verdict(
    module: HloModule,
    max_in_loop_elements: int = 8,
    mesh_shape: Mapping[str, int] | None = None,
    over: Sequence[str] = (),
    activations: Sequence[Collective] = (),
) -> dict:
    """``{"status": "OK"|"FAIL"|"VACUOUS", "message": str, ...}`` on in-loop reductions.

    With `mesh_shape` (the mesh's ordered axis -> size) and `over`, only in-loop
    reductions whose replica groups span one of the `over` axes fail; the others
    (FSDP's per-iteration reduce-scatters over its own axis, say) are counted as
    allowed and named by the axes they span. `activations`: in-loop reductions
    the caller knows carry activations, not gradients (accum's verdict reads it
    from the program: context parallelism's key/value cotangents); allowed too.
    """
    inside = in_loop_reductions(module, max_in_loop_elements)
    outside = gradient_reductions_outside(module, max_in_loop_elements)
    if over and not mesh_shape:
        raise ValueError(f"over={tuple(over)} needs mesh_shape (the mesh's axis sizes)")
    unknown = [a for a in over if a not in (mesh_shape or {})]
    if unknown:
        raise ValueError(f"axes {unknown} are not in the mesh {dict(mesh_shape)}")
    if over:
        offenders = [c for c in inside if any(spans_mesh_axis(c, mesh_shape, a) for a in over)]
    else:
        offenders = inside
    offenders = [c for c in offenders if c not in activations]
    allowed = [c for c in inside if c not in offenders]
    limit = f"> {max_in_loop_elements} elements"
    over_text = f" over {', '.join(over)}" if over else ""
    if offenders:
        per_step = [c.bytes_per_step for c in offenders]
        known = sum(b for b in per_step if b is not None)
        status = "FAIL"
        message = (
            f"FAIL: {len(offenders)} reduction(s) {limit}{over_text} inside loops "
            f"({human_bytes(known)}/step{'+' if None in per_step else ''}): "
            "gradients are reduced per iteration, not once per step"
        )
    elif outside:
        status = "OK"
        also = ""
        if allowed:
            axes = ", ".join(spanned_axes(allowed, mesh_shape))
            carried = sum(c in activations for c in allowed)
            which = f", {carried} of them carrying activations" if carried else " only"
            also = f" ({len(allowed)} per iteration over {axes}{which}, allowed)"
        what = "gradient reduction" if activations else "reduction"
        message = (
            f"OK: no {what} {limit}{over_text} inside loops{also}; "
            f"{len(outside)} gradient-sized reduction(s) outside"
        )
    else:
        status = "VACUOUS"
        message = f"VACUOUS: no reduction {limit} inside or outside loops"
    return {
        "status": status,
        "message": message,
        "in_loop": len(offenders),
        "allowed_in_loop": len(allowed),
        "outside": len(outside),
        "max_in_loop_elements": max_in_loop_elements,
    }


def human_bytes(n: int) -> str:
    """``1536`` -> ``1.5 KiB``."""
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024 or unit == "GiB":
            return f"{int(value)} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def rows(records: list[Collective]) -> list[dict]:
    """One row per (loop path, kind): count, bytes per execution, executions and bytes per step."""
    groups: dict[tuple[str, str], dict] = {}
    for c in records:
        row = groups.setdefault(
            (c.loop_path, c.kind),
            {
                "loops": c.loop_path,
                "depth": len(c.loops),
                "kind": c.kind,
                "count": 0,
                "bytes_per_execution": 0,
                "executions_per_step": 0,
                "bytes_per_step": 0,
                "exact": True,
            },
        )
        m = c.multiplier
        row["exact"] &= m is not None
        m = 1 if m is None else m
        row["count"] += 1
        row["bytes_per_execution"] += c.bytes
        row["executions_per_step"] += m
        row["bytes_per_step"] += c.bytes * m
    return sorted(groups.values(), key=lambda r: (r["depth"], r["loops"], r["kind"]))


def format_table(
    module: HloModule,
    kinds: list[str] | None = None,
    min_bytes: int = 0,
    max_in_loop_elements: int = 8,
    details: bool = False,
    verdict_line: bool = True,
    mesh_shape: Mapping[str, int] | None = None,
    over: Sequence[str] = (),
) -> str:
    """The ``hlo-report`` table: collectives grouped by loop nesting and kind, totals, verdict.

    Counts marked ``+`` sit under a loop of unknown trip count: counted once,
    so the figure is a lower bound. The verdict always looks at the whole module,
    not the filtered rows; `mesh_shape` and `over` as in `verdict`;
    `verdict_line=False` leaves it out.
    """
    records = select(collectives(module), kinds, min_bytes)
    table = rows(records)
    header = ("loops (outermost first)", "kind", "count", "bytes/exec", "exec/step", "bytes/step")
    body = []
    for r in table:
        mark = "" if r["exact"] else "+"
        body.append(
            (
                r["loops"],
                r["kind"],
                str(r["count"]),
                human_bytes(r["bytes_per_execution"]),
                f"{r['executions_per_step']}{mark}",
                human_bytes(r["bytes_per_step"]) + mark,
            )
        )
    t = traffic(records)
    exact = "" if t["exact"] else "+"
    body.append(
        (
            "total",
            "",
            str(len(records)),
            human_bytes(sum(c.bytes for c in records)),
            "",
            human_bytes(t["bytes_per_step"]) + exact,
        )
    )
    widths = [max(len(row[k]) for row in [header, *body]) for k in range(len(header))]

    def fmt(row):
        cells = [row[0].ljust(widths[0]), row[1].ljust(widths[1])]
        cells += [cell.rjust(w) for cell, w in zip(row[2:], widths[2:], strict=True)]
        return "  ".join(cells).rstrip()

    out = [
        f"module {module.name or '<unnamed>'}: {len(records)} collective(s) shown, "
        f"{module.num_devices} device(s)",
        fmt(header),
        "  ".join("-" * w for w in widths),
    ]
    out += [fmt(row) for row in body[:-1]]
    out += ["  ".join("-" * w for w in widths), fmt(body[-1])]
    if details:
        out.append("")
        for c in records:
            times = "?" if c.multiplier is None else c.multiplier
            out.append(
                f"{c.kind:<20} {c.type_str:<24} x{times:<5} groups of {c.group_size}  "
                f"{c.loop_path}  {c.op_name or '<no op_name>'}"
            )
    if verdict_line:
        out.append(verdict(module, max_in_loop_elements, mesh_shape, over)["message"])
    return "\n".join(out)


def to_json(
    module: HloModule,
    kinds: list[str] | None = None,
    min_bytes: int = 0,
    max_in_loop_elements: int = 8,
    mesh_shape: Mapping[str, int] | None = None,
    over: Sequence[str] = (),
) -> dict:
    """Everything the table shows, per collective and per row, as JSON-ready data."""
    records = select(collectives(module), kinds, min_bytes)
    return {
        "module": module.name,
        "num_devices": module.num_devices,
        "collectives": [
            {
                "kind": c.kind,
                "opcode": c.opcode,
                "name": c.name,
                "computation": c.computation,
                "dtype": c.dtype,
                "shape": c.shape,
                "elements": c.elements,
                "bytes": c.bytes,
                "group_size": c.group_size,
                "replica_groups": c.replica_groups,
                "loops": [
                    {"name": lp.name, "trip_count": lp.trip_count, "source": lp.trip_count_source}
                    for lp in c.loops
                ],
                "multiplier": c.multiplier,
                "bytes_per_step": c.bytes_per_step,
                "conditional": c.conditional,
                "op_name": c.op_name,
                "line": c.line_number,
            }
            for c in records
        ],
        "rows": rows(records),
        "traffic": traffic(records),
        "verdict": verdict(module, max_in_loop_elements, mesh_shape, over),
    }
