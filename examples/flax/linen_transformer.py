"""A linen transformer block: Embed, MultiHeadAttention, LayerNorm, Dense with bias,
Dropout, and the output tied to the embedding (`Embed.attend`), unchanged."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from common import make_mesh, replicate, shard_batch, train, weight


class Block(nn.Module):
    vocab: int = 32
    dim: int = 16

    @nn.compact
    def __call__(self, ids, deterministic=True):
        embed = nn.Embed(self.vocab, self.dim)
        x = embed(ids)
        h = nn.MultiHeadAttention(num_heads=2)(nn.LayerNorm()(x))
        x = x + nn.Dropout(0.1, deterministic=deterministic)(h)
        x = x + nn.Dense(self.dim)(nn.gelu(nn.Dense(2 * self.dim)(nn.RMSNorm()(x))))
        return embed.attend(x)  # tied output weights


def setup(mesh, rows=16, length=6, deterministic=True):
    """(loss_fn, params, batch); with `deterministic=False` loss_fn takes a dropout key."""
    model = Block()
    ids = jax.random.randint(jax.random.key(1), (rows, length + 1), 0, 32)
    params = model.init(jax.random.key(0), ids[:1, :-1])

    def loss_fn(params, mb, *rng):
        logits = model.apply(
            params,
            mb["ids"][:, :-1],
            deterministic=not rng,
            rngs={"dropout": rng[0]} if rng else {},
        )
        loss = optax.softmax_cross_entropy_with_integer_labels(logits, mb["ids"][:, 1:])
        return jnp.sum(loss), {"weight": jnp.float32(loss.size)}

    with jax.set_mesh(mesh):
        return loss_fn, replicate(mesh, params), shard_batch(mesh, {"ids": ids})


def main():
    mesh = make_mesh()
    loss_fn, params, batch = setup(mesh)
    with jax.set_mesh(mesh):
        _, losses = train(loss_fn, params, batch, optax.adamw(1e-2))
    print("linen transformer losses", losses, weight)


if __name__ == "__main__":
    main()
