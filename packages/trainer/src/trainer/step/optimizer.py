"""AdamW with linear warmup, cosine decay and global-norm clipping."""

from __future__ import annotations

import optax

from trainer.config import TrainingConfig


def learning_rate_schedule(training: TrainingConfig) -> optax.Schedule:
    """0 -> learning_rate over the warmup steps, then cosine down to the final fraction."""
    warmup = int(round(training.warmup_steps_fraction * training.steps))
    end_value = training.learning_rate * training.cosine_final_lr_fraction
    if warmup == 0:
        return optax.cosine_decay_schedule(
            training.learning_rate, max(training.steps, 1), alpha=training.cosine_final_lr_fraction
        )
    return optax.warmup_cosine_decay_schedule(
        init_value=0.0,
        peak_value=training.learning_rate,
        warmup_steps=warmup,
        decay_steps=max(training.steps, warmup + 1),
        end_value=end_value,
    )


def make_optimizer(training: TrainingConfig) -> optax.GradientTransformation:
    """The optimizer chain; clipping first so the norm is of the raw gradient.

    Takes the training group (`config.training`; a whole Config also works)."""
    chain = []
    if training.gradient_clipping_threshold > 0:
        chain.append(optax.clip_by_global_norm(training.gradient_clipping_threshold))
    chain.append(
        optax.adamw(
            learning_rate_schedule(training),
            b1=training.adam_b1,
            b2=training.adam_b2,
            eps=training.adam_eps,
            weight_decay=training.adam_weight_decay,
        )
    )
    return optax.chain(*chain)
