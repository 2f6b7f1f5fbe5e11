"""One optimizer step: loss, optimizer, gradient accumulation and when each gradient
is reduced.

- train_step.py: `make_step` (the jitted step, each gradient reduced where the plan
  says), loss.py (cross-entropy sums), optimizer.py (`make_optimizer`), with
  adam_moments.py (Adam's scaling, each moment stored in its own dtype).
- reduction_choice.py: `gradient_reduction_policy=auto`'s choice from accum's cost
  model; reduction_bytes.py: the gradient reductions the compiled step runs, counted.
"""

from trainer._lazy import exports

_EXPORTS = {
    "make_step": "trainer.step.train_step",
    "make_optimizer": "trainer.step.optimizer",
    "Choice": "trainer.step.reduction_choice",
}
__all__ = list(_EXPORTS)
__getattr__, __dir__ = exports(__name__, _EXPORTS)
