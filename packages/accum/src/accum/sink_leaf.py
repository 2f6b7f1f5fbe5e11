"""`SinkLeaf`: one parameter leaf's fused accumulation.

accum.fused_accumulate builds one per stacked parameter leaf; the fused layer
stack reads them (accum.fused finds a leaf's entry, accum.fused_scan adds into
its accumulator, accum.overlapped reduces its layer totals). A module of its own
so that all of them import it from below.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax


@dataclasses.dataclass
class SinkLeaf:
    """One parameter leaf's fused accumulation (built by accum, read by `scan_layers`).

    `acc`: the running accumulator (stacked like the parameter). `final`: None to
    accumulate into `acc`; else the slice-level target (PartitionSpec) the last
    microbatch reduces each layer's total onto. `prepare(d_slice)`: a layer's
    gradient made addable to an accumulator slice (checked, scattered, cast).
    `place(total_slice, target)`: the reduction. `sink`: the dummy primal whose
    cotangent returns the result. `ring`: a reduce-scatter onto `final` goes as a
    ring of collective-permutes (accum.ring) instead of one reduce-scatter.
    `claimed`/`used_elsewhere` are set at trace time, and so are `trace` (the JAX
    trace the parameter's tracer belongs to: only a `scan_layers` call in that very
    trace claims the leaf) and `sink_ran` (whether the claimed stack's backward
    returned the sink's cotangent at all).
    """

    acc: jax.Array
    final: Any
    prepare: Callable[[jax.Array], jax.Array]
    place: Callable[[jax.Array, Any], jax.Array]
    sink: Any = None
    ring: bool = False
    claimed: bool = False
    used_elsewhere: bool = False
    trace: Any = None
    sink_ran: bool = False
