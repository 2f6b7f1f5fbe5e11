"""The decoder over a KV cache: one jitted prefill, one jitted decode loop.

The model's own modules run every part but attention (embedding, norms, dense MLP,
MoE, output head): the MoE routes each token on its own hidden state, as in the
full forward, with no capacity cap (`capacity_factor` is 0 for generation, so no
token is dropped for sharing a batch). Attention is kv_cache.attend.

- `prefill`: the left-padded prompts [B, P] through every layer in one forward,
  their latents written at slots [0, P) of a cache of P + max_new_tokens slots; the
  logits of slot P - 1 (every row's last prompt token).
- `decode`: a `lax.while_loop` of single-token forwards, each writing its token's
  latent at the next slot, until max_new_tokens tokens or every row has ended
  (its eos). Finished rows keep stepping (fed their eos) but record -1.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from flax import nnx

from trainer import model as model_lib
from trainer.config import ModelConfig, ParallelismConfig
from trainer.generate import kv_cache
from trainer.generate.draw import sample
from trainer.generate.sampling import Sampling
from trainer.sharding import ShardCtx, logical_rules

# The scanned parameter stacks the main model runs, in order (MTP's are not run:
# generation predicts the next token only, as transformers' generate does).
STACKS = ("dense_layers", "moe_layers")
NO_TOKEN = -1  # recorded after a row's eos


@dataclasses.dataclass(frozen=True)
class Shapes:
    """What the compiled programs are specialised to."""

    batch: int
    prompt_length: int  # P: the longest prompt; shorter rows are left-padded
    max_new_tokens: int

    @property
    def cache_length(self) -> int:
        """Slots per row: the prompt and every generated token."""
        return self.prompt_length + self.max_new_tokens


def _stack_layers(config: ModelConfig) -> dict[str, int]:
    counts = {"dense_layers": config.first_num_dense_layers, "moe_layers": config.num_moe_layers}
    return {name: count for name, count in counts.items() if count}


def empty_cache(config: ModelConfig, shapes: Shapes) -> dict:
    """The cache of every layer, zero: {stack: {latent, rope_key}} stacked per layer."""
    return {
        name: kv_cache.layer_cache(config, count, shapes.batch, shapes.cache_length)
        for name, count in _stack_layers(config).items()
    }


def _block(block, x_BxSxD, positions_BxS, cache, write_index, visible_BxSxL):
    """One decoder block (model/decoder.py's Block) with cached attention."""
    attended_BxSxD, cache = kv_cache.attend(
        block.attn, block.attn_norm(x_BxSxD), positions_BxS, cache, write_index, visible_BxSxL
    )
    x_BxSxD = x_BxSxD + attended_BxSxD
    if block.is_moe:
        y_BxSxD, _ = block.ffn(block.ffn_norm(x_BxSxD))
    else:
        y_BxSxD = block.ffn(block.ffn_norm(x_BxSxD))
    return x_BxSxD + y_BxSxD, cache


def forward(decoder, tokens_BxS, start_B, write_index, cache: dict):
    """Tokens at slots [write_index, write_index + S): (f32 logits [B, V] of the last
    one, the cache with their latents written)."""
    queries, length = tokens_BxS.shape[1], next(iter(cache.values()))[kv_cache.LATENT].shape[2]
    slots_S = write_index + jnp.arange(queries)
    # Each row's positions count from its first real token (0 inside the padding,
    # which no real token sees).
    positions_BxS = jnp.maximum(slots_S[None, :] - start_B[:, None], 0)
    visible_BxSxL = kv_cache.visible(start_B, write_index, queries, length)
    x_BxSxD = decoder.embed(tokens_BxS)
    out_cache = {}
    for name in STACKS:
        if name not in cache:
            continue
        graphdef, state = nnx.split(getattr(decoder, name))

        def body(x, layer, graphdef=graphdef):
            layer_state, layer_cache = layer
            block = nnx.merge(graphdef, layer_state)
            return _block(block, x, positions_BxS, layer_cache, write_index, visible_BxSxL)

        x_BxSxD, out_cache[name] = jax.lax.scan(body, x_BxSxD, (state, cache[name]))
    last_Bx1xD = x_BxSxD[:, -1:]
    return decoder.head(decoder.final_norm(last_Bx1xD))[:, 0], out_cache


def _prefill(model, params, router, tokens_BxP, start_B, *, config: ModelConfig, shapes: Shapes):
    decoder = model_lib.build_decoder(model, params, router)
    return forward(decoder, tokens_BxP, start_B, 0, empty_cache(config, shapes))


def _decode(
    model, params, router, cache, logits_BxV, start_B, key, eos_E, *,
    shapes: Shapes, sampling: Sampling,
):  # fmt: skip
    decoder = model_lib.build_decoder(model, params, router)
    first_B = sample(logits_BxV, jax.random.fold_in(key, 0), sampling)
    out_BxN = jnp.full((shapes.batch, shapes.max_new_tokens), NO_TOKEN, jnp.int32)
    out_BxN = out_BxN.at[:, 0].set(first_B)
    ended_B = jnp.isin(first_B, eos_E)

    def running(carry):
        step, _, _, _, ended_B = carry
        return (step < shapes.max_new_tokens) & ~jnp.all(ended_B)

    def step_once(carry):
        step, cache, out_BxN, last_B, ended_B = carry
        # Token `step - 1` goes in at the slot after the prompt's and earlier ones'.
        write_index = shapes.prompt_length + step - 1
        logits_BxV, cache = forward(decoder, last_B[:, None], start_B, write_index, cache)
        next_B = sample(logits_BxV, jax.random.fold_in(key, step), sampling)
        next_B = jnp.where(ended_B, last_B, next_B)  # an ended row is fed its eos again
        recorded_B = jnp.where(ended_B, NO_TOKEN, next_B)
        out_BxN = jax.lax.dynamic_update_slice(out_BxN, recorded_B[:, None], (0, step))
        return step + 1, cache, out_BxN, next_B, ended_B | jnp.isin(next_B, eos_E)

    carry = (jnp.int32(1), cache, out_BxN, first_B, ended_B)
    return jax.lax.while_loop(running, step_once, carry)[2]


@functools.cache
def compiled(
    config: ModelConfig, parallelism: ParallelismConfig, mesh, shapes: Shapes, sampling: Sampling
):
    """(prefill, decode) jitted for this model on `mesh`, these shapes and this
    sampling. decode takes the eos ids as an array (NO_TOKEN alone: none), so they
    cost no compile."""
    ctx = ShardCtx(mesh, logical_rules(parallelism), parallelism.shard_mode)
    model = model_lib.define(config, ctx)
    prefill = jax.jit(functools.partial(_prefill, model, config=config, shapes=shapes))
    decode = jax.jit(functools.partial(_decode, model, shapes=shapes, sampling=sampling))
    return prefill, decode
