"""Where a step's gradients are added up and reduced: the accumulation schedule.

The plan (accum.plan) says *when* each gradient is reduced; the schedule says
where in the step's program that happens. Every schedule gives the same numbers.

- `plain`: each microbatch's full gradient is computed, then added into the
  accumulator; the step's one reduction runs after the microbatch loop.
- `fused`: a model that runs its layers through `accum.scan_layers` gets each
  layer's gradient added into the accumulator inside the backward layer scan (no
  full-size per-microbatch gradient buffer); the reduction runs after the loop.
  With one microbatch, or a plan whose only batch-axis reductions are autodiff's
  per-microbatch ones (`ReductionPlan.fused_applies`), it is the plain path
  (`fuses_in_scan` decides, for every caller).
- `overlapped`: fused, and the last microbatch runs after the loop and reduces
  each layer's total inside its backward layer scan, where the reduction can
  overlap the remaining layers' backward compute (accum.overlapped).
- `overlapped_ring`: overlapped, with the per-layer reduce-scatters onto ZeRO-1
  shards sent as rings of collective-permutes (accum.ring; explicit mode): the
  same bytes, asynchronous where XLA keeps a reduce-scatter synchronous.
"""

from __future__ import annotations

from typing import Literal, get_args

from accum.plan import ReductionPlan

Schedule = Literal["plain", "fused", "overlapped", "overlapped_ring"]
SCHEDULES: tuple[str, ...] = get_args(Schedule)
# The schedules that reduce inside the last microbatch's backward pass.
OVERLAPPED = ("overlapped", "overlapped_ring")


def fuses_in_scan(
    schedule: str,
    plan: ReductionPlan,
    num_microbatches: int | None = None,
    *,
    scans_layers: bool = True,
) -> bool:
    """Whether `schedule` adds the gradients inside the backward layer scan of
    `accum.scan_layers` under `plan`: the one decision `accumulate_gradients`, `add`
    and the trainer (its step and its cost model) read.

    The overlapped schedules always do (their last microbatch reduces there).
    `fused` does unless it has nothing to gain: one microbatch
    (`num_microbatches == 1`: nothing to accumulate, fusing would only add a zero
    accumulator into the backward pass) or a plan whose only batch-axis reductions
    are autodiff's per-microbatch ones (`ReductionPlan.fused_applies`).
    `num_microbatches=None`: one of an open count (`add`). `scans_layers=False`: the
    model runs no `scan_layers`, so nothing is added inside a layer scan.

    Example (`mesh`, `w`, `batch`, `loss_fn`, `SGD`: the setup in `help(accum)`):

    >>> plan = accum.plan_for(w, batch)
    >>> accum.fuses_in_scan("fused", plan, 4), accum.fuses_in_scan("fused", plan, 1)
    (True, False)
    >>> accum.fuses_in_scan("fused", accum.plan_for(w, batch, policy="per_microbatch"), 4)
    False
    """
    if not scans_layers:
        return False
    if schedule in OVERLAPPED:
        return True
    if schedule != "fused":
        return False
    return (num_microbatches is None or num_microbatches > 1) and plan.fused_applies


def check_schedule(schedule: str, plan: ReductionPlan) -> None:
    """ValueError, one line naming both, for a schedule unknown or meaningless under `plan`.

    `overlapped_ring` rings the step's one reduction of unreduced partial sums:
    auto mode carries none (XLA places every reduction) and a `per_microbatch`
    plan has none left after the loop (autodiff reduced each microbatch's).

    Example (`mesh`, `w`, `batch`, `loss_fn`, `SGD`: the setup in `help(accum)`):

    >>> plan = accum.plan_for(w, batch, policy="per_microbatch")
    >>> accum.check_schedule("overlapped_ring", plan)
    Traceback (most recent call last):
    ...
    ValueError: schedule='overlapped_ring' does nothing under policy='per_microbatch' ...
    """
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule={schedule!r} is not one of {SCHEDULES}")
    if schedule != "overlapped_ring":
        return
    if plan.mode != "explicit":
        raise ValueError(
            f"schedule='overlapped_ring' needs explicit mode (mode={plan.mode!r} lets XLA "
            "place every reduction); use schedule='overlapped'"
        )
    if plan.policy == "per_microbatch":
        raise ValueError(
            "schedule='overlapped_ring' does nothing under policy='per_microbatch' (every "
            "gradient is reduced in its microbatch's backward); use schedule='overlapped'"
        )
