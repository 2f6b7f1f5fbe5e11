"""AdamW with linear warmup, cosine decay and global-norm clipping."""

from __future__ import annotations

import optax

from trainer.config import Config


def learning_rate_schedule(config: Config) -> optax.Schedule:
    """0 -> learning_rate over the warmup steps, then cosine down to the final fraction."""
    warmup = int(round(config.warmup_steps_fraction * config.steps))
    end_value = config.learning_rate * config.cosine_final_lr_fraction
    if warmup == 0:
        return optax.cosine_decay_schedule(
            config.learning_rate, max(config.steps, 1), alpha=config.cosine_final_lr_fraction
        )
    return optax.warmup_cosine_decay_schedule(
        init_value=0.0,
        peak_value=config.learning_rate,
        warmup_steps=warmup,
        decay_steps=max(config.steps, warmup + 1),
        end_value=end_value,
    )


def make_optimizer(config: Config) -> optax.GradientTransformation:
    """The optimizer chain; clipping first so the norm is of the raw gradient."""
    chain = []
    if config.gradient_clipping_threshold > 0:
        chain.append(optax.clip_by_global_norm(config.gradient_clipping_threshold))
    chain.append(
        optax.adamw(
            learning_rate_schedule(config),
            b1=config.adam_b1,
            b2=config.adam_b2,
            eps=config.adam_eps,
            weight_decay=config.adam_weight_decay,
        )
    )
    return optax.chain(*chain)
