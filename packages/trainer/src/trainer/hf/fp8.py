"""DeepSeek's fp8 weights: e4m3 values times a float32 scale per 128x128 block.

`weight_scale_inv` has shape [ceil(out/128), ceil(in/128)] and, despite its name,
multiplies the stored values; the last block of each dim may be partial.
"""

from __future__ import annotations

import math

import numpy as np

BLOCK = 128


def scale_shape(shape: tuple[int, ...]) -> tuple[int, int]:
    """The block-scale shape of an [out, in] weight."""
    out_dim, in_dim = shape
    return (math.ceil(out_dim / BLOCK), math.ceil(in_dim / BLOCK))


def dequantize(weight_OxI: np.ndarray, scale_inv: np.ndarray) -> np.ndarray:
    """float32 weight = e4m3 values x their block's scale."""
    out_dim, in_dim = weight_OxI.shape
    weight = np.asarray(weight_OxI).astype(np.float32)
    scale = np.asarray(scale_inv, np.float32)
    # One block row at a time: no full-size scale array beside the weight.
    for row in range(scale.shape[0]):
        weight[row * BLOCK : (row + 1) * BLOCK] *= np.repeat(scale[row], BLOCK)[:in_dim]
    return weight
