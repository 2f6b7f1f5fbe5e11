"""When to evaluate: every `eval_interval` steps and after the last one."""

from __future__ import annotations

from trainer.config.run_keys import EvaluationConfig, TrainingConfig


def enabled(evaluation: EvaluationConfig) -> bool:
    """Evaluation is on when `eval_interval` is positive (MaxText: -1 = never)."""
    return evaluation.eval_interval > 0


def due(training: TrainingConfig, evaluation: EvaluationConfig, step: int) -> bool:
    """Evaluate after `step`: every `eval_interval` steps and after the last one."""
    return enabled(evaluation) and (step % evaluation.eval_interval == 0 or step == training.steps)
