"""The jaxprs nested in an equation (scan, while, cond, and the one-to-one ones:
jit, remat, shard_map, custom_jvp/vjp calls) and how their inputs and outputs map
onto the equation's, for the trace-time guard's walk (accum.guard_walk).
"""

from __future__ import annotations

import dataclasses
from typing import Any


def scan_counts(params: dict, n_in: int) -> tuple[int, int]:
    """(consts, carries) among a scan's operands.

    JAX up to 0.10 names the counts (`num_consts`, `num_carry`); newer JAX keeps
    the operand structure in `ft_in`, whose unpack splits operands into
    (consts, carry, xs): unpacking the operand indices gives the counts.
    """
    if "num_carry" in params:
        return params["num_consts"], params["num_carry"]
    consts, carry, _ = params["ft_in"].update(list(range(n_in))).unpack()
    return len(consts), len(carry)


@dataclasses.dataclass
class Region:
    """A nested jaxpr and how its inputs/outputs map onto the outer equation's.

    `ins[i]` / `outs[j]`: outer invar / outvar index of sub invar i / outvar j
    (None: unmapped). `loop`: (sub outvar, sub invar) pairs fed back each
    iteration (scan and while carries).
    """

    jaxpr: Any
    ins: list[int | None]
    outs: list[int | None]
    loop: list[tuple[int, int]] = dataclasses.field(default_factory=list)


def open_jaxpr(obj: Any) -> Any | None:
    """The open Jaxpr of a Jaxpr or ClosedJaxpr; None for anything else."""
    inner = getattr(obj, "jaxpr", None)
    if inner is not None and hasattr(inner, "eqns"):
        return inner
    return obj if hasattr(obj, "eqns") else None


def nested_regions(eqn: Any) -> list[Region]:
    """Every nested jaxpr of `eqn`, mapped by the primitive's known layout.

    scan, while and cond have their own operand layouts; everything else JAX
    nests (jit, closed_call, remat, shard_map, custom_jvp/vjp calls) maps its
    operands and results one to one.
    """
    name, params = eqn.primitive.name, eqn.params
    n_in, n_out = len(eqn.invars), len(eqn.outvars)
    if name == "scan":
        consts, carry = scan_counts(params, n_in)
        return [
            Region(
                open_jaxpr(params["jaxpr"]),
                list(range(n_in)),
                list(range(n_out)),
                [(i, consts + i) for i in range(carry)],
            )
        ]
    if name == "while":
        cn, bn = params["cond_nconsts"], params["body_nconsts"]
        carry = list(range(cn + bn, n_in))
        body = Region(
            open_jaxpr(params["body_jaxpr"]),
            list(range(cn, cn + bn)) + carry,
            list(range(n_out)),
            [(i, bn + i) for i in range(n_out)],
        )
        cond = Region(open_jaxpr(params["cond_jaxpr"]), list(range(cn)) + carry, [None])
        return [body, cond]
    if name == "cond":
        return [
            Region(open_jaxpr(b), list(range(1, n_in)), list(range(n_out)))
            for b in params["branches"]
        ]
    found = []
    for value in params.values():
        for item in value if isinstance(value, tuple | list) else (value,):
            sub = open_jaxpr(item)
            if sub is not None and len(sub.invars) == n_in and len(sub.outvars) == n_out:
                found.append(Region(sub, list(range(n_in)), list(range(n_out))))
    return found
