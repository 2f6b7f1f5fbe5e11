"""AdamW with linear warmup, cosine decay and global-norm clipping."""

from __future__ import annotations

import jax.numpy as jnp
import optax

from trainer.config import TrainingConfig
from trainer.step.adam_moments import scale_by_adam_moments


def warmup_steps(training: TrainingConfig) -> int:
    """The linear warmup's steps: warmup_steps when set (>= 0), else the fraction."""
    if training.warmup_steps >= 0:
        return training.warmup_steps
    return int(round(training.warmup_steps_fraction * training.steps))


def learning_rate_schedule(training: TrainingConfig) -> optax.Schedule:
    """0 -> learning_rate over the warmup steps, then lr_scheduler_type's decay: cosine
    down to the final fraction, linear down to 0 at the last step (transformers'
    get_linear_schedule_with_warmup), or constant (its constant_with_warmup)."""
    warmup = warmup_steps(training)
    peak = training.learning_rate
    if training.lr_scheduler_type in ("linear", "constant"):
        end = 0.0 if training.lr_scheduler_type == "linear" else peak
        after = optax.linear_schedule(peak, end, max(training.steps - warmup, 1))
        if warmup == 0:
            return after
        return optax.join_schedules([optax.linear_schedule(0.0, peak, warmup), after], [warmup])
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

    AdamW as `optax.adamw` composes it (Adam's scaling, decoupled weight decay, the
    learning rate), with Adam's moments stored in mu_dtype / nu_dtype ('': each
    parameter's dtype; step/adam_moments.py). Takes the training group
    (`config.training`; a whole Config also works)."""
    chain = []
    if training.gradient_clipping_threshold > 0:
        chain.append(optax.clip_by_global_norm(training.gradient_clipping_threshold))
    # Nested as optax.adamw's own chain, so the state's tree (and a checkpoint's array
    # names) is the one optax.adamw gave.
    adamw = optax.chain(
        scale_by_adam_moments(
            b1=training.adam_b1,
            b2=training.adam_b2,
            eps=training.adam_eps,
            mu_dtype=moment_dtype(training.mu_dtype),
            nu_dtype=moment_dtype(training.nu_dtype),
        ),
        optax.add_decayed_weights(training.adam_weight_decay),
        optax.scale_by_learning_rate(learning_rate_schedule(training)),
    )
    return optax.chain(*chain, adamw)


def moment_dtype(name: str):
    """A moment dtype key's value as a dtype; None for '' (the parameter's own)."""
    return jnp.dtype(name) if name else None
