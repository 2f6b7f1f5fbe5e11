"""cuDNN's fused attention for MLA: its causal mode, packed documents, v at its own dim.

What the public `jax.nn.dot_product_attention(implementation="cudnn")` takes (JAX
0.10.2 to 0.12): `is_causal`, one sequence length per row, and a boolean mask,
with v of k's head dim. A packed row holds several documents, which that API can
only express as a (B, 1, S, S) mask (cuDNN reads it as a bf16 bias, forward and
backward), and an MLA value (64 here) narrower than its keys (96) must be
zero-padded. The call under it, `jax._src.cudnn.fused_attention_stablehlo.
dot_product_attention`, takes per-document lengths and offsets (cuDNN's packed,
"ragged" layout: each document attends causally within itself) and v of its own
head dim (cuDNN >= 9.10 on Hopper). It is JAX-internal but stable across those
releases (same keywords); `plan` checks its signature and the cuDNN version and
says on the startup line what it falls back to, and why:

- no such module or keywords: the public API, the (S, S) segment mask and v padded;
- an older GPU than Hopper (packed layout and MLA need sm_90): the same;
- cuDNN < 9.10: packed documents, v padded.

Documents are the maximal runs of equal segment ids in a row (the packer writes
each document's tokens contiguously, padding as id 0 at the end), so the padding
run attends within itself exactly as under the segment mask. The packed call takes
at most MAX_DOCUMENTS per row (its static shape); a microbatch with a row of more
runs the masked call instead (a `lax.cond` per device: the same numbers, slower,
its forward recomputed in the backward).
"""

from __future__ import annotations

import dataclasses
import functools
import inspect

import jax
import jax.numpy as jnp

# Documents per row the packed call is shaped for: its lengths and offsets are
# (B, MAX_DOCUMENTS[+1]) int32, and cuDNN's grid grows with it (an empty slot is an
# idle tile), so it is small; a row packing more takes the masked call.
MAX_DOCUMENTS = 16
# cuDNN releases as cudnnGetVersion() reports them (9.10.0: 91000).
MLA_CUDNN = 91000
PACKED_KEYWORDS = ("q_seqlen", "kv_seqlen", "q_offsets", "kv_offsets", "mask_type", "qkv_layout")


@dataclasses.dataclass(frozen=True)
class CudnnPlan:
    """How the cuDNN call runs: packed documents (else an (S, S) mask), v at its own
    head dim (else zero-padded to q's); `why` names what turned a feature off."""

    packed: bool
    v_own_dim: bool
    why: tuple[str, ...] = ()

    def describe(self) -> str:
        """The startup line's words for it."""
        docs = (
            f"documents as packed segments (up to {MAX_DOCUMENTS} per row, else an (S,S) mask)"
            if self.packed
            else "documents by an (S,S) mask"
        )
        v = "v at its own head dim" if self.v_own_dim else "v zero-padded to q's head dim"
        why = f"; {'; '.join(self.why)}" if self.why else ""
        return f"causal mode, {docs}, {v}{why}"


def internal_api():
    """JAX's internal cuDNN attention module, or (None, why not)."""
    try:
        from jax._src.cudnn import fused_attention_stablehlo as api
    except ImportError as error:  # the module moved or went
        return None, f"jax._src.cudnn.fused_attention_stablehlo: {error}"
    params = inspect.signature(api.dot_product_attention).parameters
    missing = [k for k in PACKED_KEYWORDS if k not in params]
    if missing or not hasattr(api.MaskType, "PADDING_CAUSAL"):
        return None, f"its dot_product_attention lacks {', '.join(missing) or 'PADDING_CAUSAL'}"
    return api, ""


def plan(devices, v_dim: int, qk_dim: int) -> CudnnPlan:
    """What the cuDNN call can use on these GPUs (read once, when the model is built)."""
    api, why = internal_api()
    if api is None:
        return CudnnPlan(False, False, (f"public API only ({why})",))
    capability = min(tuple(int(x) for x in d.compute_capability.split(".")) for d in devices)
    if capability < (9, 0):
        return CudnnPlan(False, False, (f"sm_{capability[0]}{capability[1]} is older than Hopper",))
    try:
        version = int(api.check_cudnn_version())
    except RuntimeError as error:
        return CudnnPlan(False, False, (f"cuDNN version unknown ({error})",))
    if v_dim != qk_dim and version < MLA_CUDNN:
        return CudnnPlan(True, False, (f"cuDNN {version} < {MLA_CUDNN} for v's own head dim",))
    return CudnnPlan(True, True)


def documents(segments_BxS: jax.Array, max_documents: int = MAX_DOCUMENTS):
    """cuDNN's packed layout of each row's documents (maximal runs of equal ids):
    (lengths (B, M), start offsets (B, M + 1), both -1 past the row's last document,
    and whether every row has at most M = max_documents)."""
    same = segments_BxS[:, 1:] == segments_BxS[:, :-1]
    starts = jnp.concatenate([jnp.ones_like(same[:, :1]), ~same], axis=1)
    doc_BxS = jnp.cumsum(starts.astype(jnp.int32), axis=1) - 1
    count_B = doc_BxS[:, -1] + 1
    m = jnp.arange(max_documents + 1, dtype=jnp.int32)
    lengths = jnp.sum(doc_BxS[:, :, None] == m[:-1], axis=1, dtype=jnp.int32)
    offsets = jnp.sum(doc_BxS[:, :, None] < m, axis=1, dtype=jnp.int32)
    lengths = jnp.where(m[:-1] < count_B[:, None], lengths, -1)
    offsets = jnp.where(m < count_B[:, None], offsets, -1)
    return lengths, offsets, jnp.all(count_B <= max_documents)


def masked(q, k, v, seg_q, seg_kv, scale, implementation="cudnn"):
    """The public API: causal mode and the documents as a boolean (B, 1, S, U) mask,
    v zero-padded to q's head dim (and the padding sliced off the output).
    `implementation="xla"`: JAX's reference kernel (how the CPU tests check it)."""
    v_dim, k_dim = v.shape[-1], q.shape[-1]
    v_pad = jnp.pad(v, ((0, 0), (0, 0), (0, 0), (0, k_dim - v_dim)))
    mask_Bx1xSxU = (seg_q[:, :, None] == seg_kv[:, None, :])[:, None]
    out = jax.nn.dot_product_attention(
        q, k, v_pad, mask=mask_Bx1xSxU, is_causal=True, scale=scale,
        implementation=implementation,
    )  # fmt: skip
    return out[..., :v_dim]


def packed(q, k, v, seg_q, scale, v_own_dim: bool):
    """cuDNN with each row's documents as packed segments (causal within each): no
    (S, S) operand. Rows of more than MAX_DOCUMENTS documents take `masked`."""
    api, why = internal_api()
    if api is None:
        raise RuntimeError(f"cuDNN's packed attention is unavailable: {why}")
    v_dim = v.shape[-1]
    if not v_own_dim:
        v = jnp.pad(v, ((0, 0), (0, 0), (0, 0), (0, q.shape[-1] - v_dim)))
    lengths, offsets, fits = documents(seg_q)

    def run_packed(q, k, v):
        out = api.dot_product_attention(
            q, k, v, q_seqlen=lengths, kv_seqlen=lengths, q_offsets=offsets,
            kv_offsets=offsets, scale=scale, mask_type=api.MaskType.PADDING_CAUSAL,
            qkv_layout="BTNH",
        )  # fmt: skip
        return out[..., :v_dim]

    # Differentiated, a lax.cond returns the residuals of both branches, zeros for the
    # one not taken: every packed call wrote the masked call's (its padded v, mask,
    # output) as zeros (the cuDNN compile's cross-check on
    # benchmarks/results/gpu_estimate.md). Saving nothing, the fallback has no
    # residuals; it recomputes its forward in the backward, on the rare rows of more
    # than MAX_DOCUMENTS documents.
    @functools.partial(jax.checkpoint, policy=jax.checkpoint_policies.nothing_saveable)
    def run_masked(q, k, v):
        return masked(q, k, v[..., :v_dim], seg_q, seg_q, scale)

    return jax.lax.cond(fits, run_packed, run_masked, q, k, v)
