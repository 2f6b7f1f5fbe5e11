"""A decoder-only language model in stock nnx, trained with accum and AdamW.

The embedding is tied: `nnx.Embed` looks tokens up and its `attend` gives the
output logits. Each block is a causal `nnx.MultiHeadAttention` and an MLP, both
behind `nnx.Dropout`. The loss is the summed next-token cross-entropy over the
tokens the mask counts, and `aux["weight"]` is that count (accum's loss
contract, docs/accum.md): the step's loss is then the token-weighted mean over
the whole batch, however it is split.

Dropout takes its key from `loss_fn`'s third argument: `accumulate_gradients`
gives microbatch i `fold_in(rng, i)`, so pass a fresh `rng` each step. With
dropout off (`train=False`) the step's gradients are the full batch's
(`check_against_full_batch`, run by tests/test_flax_examples.py)."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
from common import make_mesh, replicate, shard_batch
from flax import nnx

import accum

VOCAB, DIM, HEADS, LAYERS, LENGTH, RATE = 32, 16, 2, 2, 8, 0.1


class Block(nnx.Module):
    def __init__(self, rngs):
        self.norm1 = nnx.LayerNorm(DIM, rngs=rngs)
        # No biases: a key bias's gradient is zero (softmax ignores a shift shared
        # by all keys), so its value is rounding noise, which AdamW's first
        # step scales to +-lr differently in any two summation orders.
        self.attn = nnx.MultiHeadAttention(
            num_heads=HEADS, in_features=DIM, decode=False, use_bias=False, rngs=rngs
        )
        self.norm2 = nnx.LayerNorm(DIM, rngs=rngs)
        self.up = nnx.Linear(DIM, 4 * DIM, rngs=rngs)
        self.down = nnx.Linear(4 * DIM, DIM, rngs=rngs)
        self.drop = nnx.Dropout(RATE)

    def __call__(self, x, mask, rngs, train):
        off = not train
        x = x + self.drop(self.attn(self.norm1(x), mask=mask), deterministic=off, rngs=rngs)
        h = self.down(nnx.gelu(self.up(self.norm2(x))))
        return x + self.drop(h, deterministic=off, rngs=rngs)


class DecoderLM(nnx.Module):
    def __init__(self, rngs):
        self.embed = nnx.Embed(VOCAB, DIM, rngs=rngs)
        self.pos = nnx.Param(0.02 * jax.random.normal(rngs.params(), (LENGTH, DIM)))
        self.blocks = nnx.List([Block(rngs) for _ in range(LAYERS)])
        self.norm = nnx.LayerNorm(DIM, rngs=rngs)

    def __call__(self, tokens, rngs=None, train=False):
        x = self.embed(tokens) + self.pos[: tokens.shape[1]]
        mask = nnx.make_causal_mask(tokens)  # each position sees itself and the past
        for block in self.blocks:
            x = block(x, mask, rngs, train)
        return self.embed.attend(self.norm(x))  # tied: the embedding's transpose


def make_loss(graphdef, train=True):
    """loss_fn(params, microbatch, rng) -> (summed next-token CE, {"weight": tokens})."""

    def loss_fn(params, mb, rng=None):
        model = nnx.merge(graphdef, params)
        rngs = nnx.Rngs(dropout=rng) if train else None
        logits = model(mb["tokens"][:, :-1], rngs=rngs, train=train)
        targets, counted = mb["tokens"][:, 1:], mb["mask"][:, 1:]
        ce = optax.softmax_cross_entropy_with_integer_labels(logits, targets)
        return jnp.sum(ce * counted), {"weight": jnp.sum(counted)}

    return loss_fn


def setup(mesh, rows=32):
    """(graphdef, params replicated, batch with rows over 'data') on `mesh`."""
    graphdef, params = nnx.split(DecoderLM(nnx.Rngs(0)))
    key_t, key_m = jax.random.split(jax.random.key(1))
    tokens = jax.random.randint(key_t, (rows, LENGTH + 1), 0, VOCAB)
    # Padding at the end of some rows: those tokens are not counted.
    lengths = jax.random.randint(key_m, (rows, 1), LENGTH // 2, LENGTH + 2)
    mask = (jnp.arange(LENGTH + 1)[None] < lengths).astype(jnp.float32)
    with jax.set_mesh(mesh):
        return (
            graphdef,
            replicate(mesh, params),
            shard_batch(mesh, {"tokens": tokens, "mask": mask}),
        )


def adamw():
    return optax.adamw(1e-3, weight_decay=0.01)


def accum_step(loss_fn, optimizer, num_microbatches=2):
    """The training step: GA over `num_microbatches`, one AdamW update."""

    def step(params, state, batch, rng):
        return accum.train_step(
            loss_fn, optimizer, params, state, batch, num_microbatches=num_microbatches, rng=rng
        )

    return step


def plain_step(loss_fn, optimizer):
    """The reference: one `jax.grad` over the whole batch, the same AdamW update."""

    def step(params, state, batch):
        def mean(p):
            loss_sum, aux = loss_fn(p, batch)
            return loss_sum / aux["weight"]

        loss, grads = jax.value_and_grad(mean)(params)
        updates, state = optimizer.update(grads, state, params)
        return optax.apply_updates(params, updates), state, loss, grads

    return step


def check_against_full_batch(mesh, steps=2):
    """Dropout off: `steps` AdamW steps through accum and through the plain
    full-batch step from the same start; returns both (params, losses)."""
    graphdef, params, batch = setup(mesh)
    loss_fn, optimizer = make_loss(graphdef, train=False), adamw()
    with jax.set_mesh(mesh):
        state = optimizer.init(params)
        step = accum.compile_checked(accum_step(loss_fn, optimizer), params, state, batch, None)
        ours, losses = (params, state), []
        for _ in range(steps):
            p, s, loss, _ = step(*ours, batch, None)
            ours, losses = (p, s), [*losses, float(loss)]
    plain = jax.jit(plain_step(loss_fn, optimizer))
    ref, ref_losses = jax.device_get((params, optimizer.init(params))), []
    host_batch = jax.device_get(batch)
    for _ in range(steps):
        p, s, loss, _ = plain(*ref, host_batch)
        ref, ref_losses = (p, s), [*ref_losses, float(loss)]
    return (ours[0], losses), (ref[0], ref_losses), step


def main(steps=5):
    """Train with dropout on, a fresh key each step; print the losses."""
    mesh = make_mesh()
    graphdef, params, batch = setup(mesh)
    loss_fn, optimizer = make_loss(graphdef, train=True), adamw()
    key = jax.random.key(2)
    with jax.set_mesh(mesh):
        state = optimizer.init(params)
        step = accum.compile_checked(accum_step(loss_fn, optimizer), params, state, batch, key)
        losses = []
        for i in range(steps):
            params, state, loss, _ = step(params, state, batch, jax.random.fold_in(key, i))
            losses.append(float(loss))
    print("nnx decoder LM losses", np.round(losses, 4).tolist())
    return losses


if __name__ == "__main__":
    main()
