"""Rotary position embeddings: plain RoPE and YaRN, on half-split or interleaved pairs.

Keys (MaxText's names): `rope_type` ("default" | "yarn"), `rope_max_timescale`
(theta), `rope_factor`, `original_max_position_embeddings`, `beta_fast`,
`beta_slow`, `mscale`, `mscale_all_dim`, `rope_interleave`, `rope_truncate`,
`rope_attention_scaling`. With m(s, k) = 0.1 k ln(s) + 1 (YaRN's magnitude
correction), a YaRN model:

- blends each frequency between inv / factor (interpolated) and inv (kept) along
  a linear ramp over the pair index between the dims where the original context
  turns beta_fast and beta_slow times (`yarn_frequencies`);
- scales the rotated q and k by m(factor, mscale) / m(factor, mscale_all_dim),
  times m(factor, 1) with `rope_attention_scaling` (`output_scale`);
- multiplies the softmax scale by m(factor, mscale_all_dim)^2 (`softmax_scale`).

`mscale_all_dim` < 0 (the default) means "equal to mscale", MaxText's one-key
meaning: q and k unscaled, the softmax scale times m(factor, mscale)^2.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from trainer.config import ModelConfig


def yarn_magnitude(factor: float, coefficient: float) -> float:
    """YaRN's m(s, k) = 0.1 k ln(s) + 1 (1 when s <= 1, as DeepSeek's code)."""
    if factor <= 1:
        return 1.0
    return 0.1 * coefficient * math.log(factor) + 1.0


def mscale_all_dim(config: ModelConfig) -> float:
    """The effective mscale_all_dim: the key, or `mscale` when the key is < 0."""
    return config.mscale if config.mscale_all_dim < 0 else config.mscale_all_dim


def _correction_dim(rotations: float, dim: int, theta: float, original: int) -> float:
    """The (fractional) rope dim whose wavelength fits `rotations` times in `original`."""
    return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))


def yarn_ramp_bounds(config: ModelConfig) -> tuple[float, float]:
    """(low, high): where the ramp from interpolated to kept frequencies runs,
    floored/ceiled with `rope_truncate`, clamped to [0, R - 1]."""
    dim, theta = config.qk_rope_head_dim, float(config.rope_max_timescale)
    original = config.original_max_position_embeddings
    low = _correction_dim(config.beta_fast, dim, theta, original)
    high = _correction_dim(config.beta_slow, dim, theta, original)
    if config.rope_truncate:
        low, high = math.floor(low), math.ceil(high)
    return max(low, 0), min(high, dim - 1)


def yarn_frequencies(config: ModelConfig) -> np.ndarray:
    """YaRN's per-pair angular frequencies (R/2,), float32, computed in float64."""
    half = config.qk_rope_head_dim // 2
    inv_R2 = float(config.rope_max_timescale) ** (-np.arange(half, dtype=np.float64) / half)
    low, high = yarn_ramp_bounds(config)
    if low == high:
        high += 0.001  # a one-point ramp: a step, as the reference implementations
    ramp_R2 = np.clip((np.arange(half, dtype=np.float64) - low) / (high - low), 0.0, 1.0)
    # ramp 0 (fast-turning pairs, below `low`): kept; ramp 1 (slow ones): / factor.
    blended = inv_R2 / config.rope_factor * ramp_R2 + inv_R2 * (1.0 - ramp_R2)
    return blended.astype(np.float32)


def output_scale(config: ModelConfig) -> float:
    """What the rotated q and k are multiplied by (1.0 for plain RoPE)."""
    if config.rope_type != "yarn":
        return 1.0
    factor = config.rope_factor
    scale = yarn_magnitude(factor, config.mscale) / yarn_magnitude(factor, mscale_all_dim(config))
    if config.rope_attention_scaling:
        scale *= yarn_magnitude(factor, 1.0)
    return scale


def softmax_scale(config: ModelConfig) -> float:
    """The attention logits' scale: qk_head_dim^-0.5, times m(factor, mscale_all_dim)^2
    under YaRN (DeepSeek's correction)."""
    scale = config.qk_head_dim**-0.5
    if config.rope_type == "yarn":
        scale *= yarn_magnitude(config.rope_factor, mscale_all_dim(config)) ** 2
    return scale


def _plain_frequencies(half: int, max_timescale: int) -> jax.Array:
    return max_timescale ** (-jnp.arange(half, dtype=jnp.float32) / half)


def _frequencies(config: ModelConfig, half: int) -> jax.Array:
    if config.rope_type == "yarn":
        return jnp.asarray(yarn_frequencies(config))
    return _plain_frequencies(half, config.rope_max_timescale)


def _rotate(x, positions_BxS, config: ModelConfig, start: int):
    """x with its dims [start:] rotated, in f32, cast back to x's dtype; dims [:start]
    pass through unchanged (in one fusion with the rotation)."""
    head, tail = x[..., :start], x[..., start:]
    half = tail.shape[-1] // 2
    angle = positions_BxS.astype(jnp.float32)[..., None] * _frequencies(config, half)
    angle_BxSx1xR2 = angle[:, :, None, :]
    sin, cos = jnp.sin(angle_BxSx1xR2), jnp.cos(angle_BxSx1xR2)
    x32 = tail.astype(jnp.float32)
    if config.rope_interleave:
        pairs = x32.reshape(*x32.shape[:-1], half, 2)
        first, second = pairs[..., 0], pairs[..., 1]
    else:
        first, second = x32[..., :half], x32[..., half:]
    rotated_first, rotated_second = first * cos - second * sin, second * cos + first * sin
    if config.rope_interleave:
        rotated = jnp.stack([rotated_first, rotated_second], axis=-1).reshape(x32.shape)
    else:
        rotated = jnp.concatenate([rotated_first, rotated_second], axis=-1)
    scale = output_scale(config)
    if scale != 1.0:
        rotated = rotated * scale
    rotated = rotated.astype(x.dtype)
    return jnp.concatenate([head, rotated], axis=-1) if start else rotated


def rope(
    x_BxSxHxR: jax.Array, positions_BxS: jax.Array, config: ModelConfig, start: int = 0
) -> jax.Array:
    """Rotary embedding on the last dim's [start:] (all of it by default), computed in
    f32 and returned in the input's dtype; the dims before `start` pass through.

    Pairs are (i, i + R/2) (half-split, the default) or (2i, 2i + 1) with
    `rope_interleave` (DeepSeek's and Hugging Face's weight layout, so their
    weights load unpermuted); the output keeps the input's layout. `start`: an MLA
    query's nope dims go through untouched, so the model slices and concatenates
    nothing around it. (A custom VJP, the opposite rotation recomputed from the
    positions, measured 2 more copy kernels per microbatch on the deviceless H100
    compile than autodiff's chain, which XLA fuses as well: issue 53.)
    """
    return _rotate(x_BxSxHxR, positions_BxS, config, start)
