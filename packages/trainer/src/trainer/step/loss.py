"""Token-weighted cross-entropy that works on vocab-sharded logits in both modes."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

import pspec_tags as pt


def token_cross_entropy(logits_BxSxV: jax.Array, targets_BxS: jax.Array) -> jax.Array:
    """-log p(target) per token, laid out like the tokens (unweighted)."""
    lse_BxS = jax.nn.logsumexp(logits_BxSxV, axis=-1)
    return lse_BxS - target_logit(logits_BxSxV, targets_BxS)


def target_logit(logits_BxSxV: jax.Array, targets_BxS: jax.Array) -> jax.Array:
    """The target's logit per token, laid out like the tokens."""
    # A vocab index per logit, laid out exactly like the logits: comparing it with
    # the targets is then a plain elementwise op even when the vocab is sharded.
    spec = pt.spec_of(logits_BxSxV)
    vocab_BxSxV = lax.broadcasted_iota(
        jnp.int32,
        logits_BxSxV.shape,
        2,
        # TAG: laid out like the logits: the comparison below stays elementwise,
        # with no gather or reshard of the (possibly vocab-sharded) logits.
        out_sharding=jax.typeof(logits_BxSxV).sharding if spec is not None else None,
    )
    hit_BxSxV = vocab_BxSxV == targets_BxS[..., None]
    return jnp.sum(jnp.where(hit_BxSxV, logits_BxSxV, 0.0), axis=-1)


def cross_entropy_sum(
    logits_BxSxV: jax.Array,
    targets_BxS: jax.Array,
    weights_BxS: jax.Array,
    *,
    keep_unreduced: bool = False,
) -> tuple[jax.Array, jax.Array]:
    """(Σ weight * -log p(target), Σ weight): sums, so microbatches add up exactly.

    `keep_unreduced`: in explicit mode the two sums come back unreduced over the
    token-sharding axes (per-device partial sums, `pspec_tags.unreduced_sum`),
    so a microbatch loop adds them up with no collective and accum reduces
    them once after it; elsewhere they are plain sums.
    """
    nll_BxS = token_cross_entropy(logits_BxSxV, targets_BxS)
    return weighted_sums(nll_BxS, weights_BxS, keep_unreduced=keep_unreduced)


def weighted_sums(
    nll_BxS: jax.Array, weights_BxS: jax.Array, *, keep_unreduced: bool = False
) -> tuple[jax.Array, jax.Array]:
    """(Σ weight * nll, Σ weight) of per-token losses; `keep_unreduced` as in
    `cross_entropy_sum`."""
    weights_BxS = weights_BxS.astype(jnp.float32)
    # TAG: jnp.sum over token-sharded rows all-reduces each scalar right here,
    # once per microbatch; unreduced_sum leaves that to the end of the step.
    total = pt.unreduced_sum if keep_unreduced else jnp.sum
    return total(nll_BxS * weights_BxS), total(weights_BxS)


def top1_hits(logits_BxSxV: jax.Array, targets_BxS: jax.Array) -> jax.Array:
    """1.0 where the target's logit is the largest (the top-1 prediction), else 0.0;
    laid out like the tokens. Compares logits, so a vocab-sharded row needs no argmax."""
    hit_BxS = target_logit(logits_BxSxV, targets_BxS) >= jnp.max(logits_BxSxV, axis=-1)
    return hit_BxS.astype(jnp.float32)
