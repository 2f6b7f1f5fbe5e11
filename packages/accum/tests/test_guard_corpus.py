"""The guard's verdict against the compiled program, idiom by idiom.

Each case is a tiny `loss_fn` on a data-sharded explicit mesh. Tag-safe
idioms must pass the guard; tag-dropping ones must raise `TagLostError`
naming the parameter and the line marked `# DROP`. For every case the verdict
must agree with the compiled step (on_tag_lost="ignore"): a gradient-sized
reduction inside the microbatch loop exactly when the guard raises.
"""

from __future__ import annotations

import inspect
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import accum
import hlo_tools as ht
import pspec_tags as pt
from pspec_tags import TagLostError

VOCAB, DIM, LAYERS, BATCH, SEQ = 16, 16, 2, 32, 4  # every gradient > 8 elements
ACT = P("data", None, None)


# ---------------------------------------------------------------- helpers the cases share


def _dot(eq, a, b):
    """An einsum whose output is batch-sharded activations."""
    return jnp.einsum(eq, a, b, out_sharding=ACT)


def _loss(y):
    """(loss_sum, aux): squared activations; the weight counts the microbatch's tokens."""
    return jnp.sum(y * y), {"weight": jnp.float32(y.shape[0] * y.shape[1])}


def _embed(p, mb):
    """A tag-safe embedding: the common JAX way (the idiom issue 15 is about)."""
    return p["embed"].at[mb["ids"]].get(out_sharding=ACT)


def _rms_norm(x, scale):
    h = x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + 1e-6)
    return h * pt.broadcast_param(scale, h)


# ---------------------------------------------------------------- tag-safe idioms


def take(p, mb):
    # jnp.take on a tagged table iterates its spec (ValueError on JAX 0.10), so
    # it runs per device, as in the toy model: a local take in a shard_map.
    def local(table, ids):
        return jnp.take(pt.to_varying(table, "data"), ids, axis=0)

    table = p["embed"]
    x = jax.shard_map(local, in_specs=(pt.spec_of(table), P("data")), out_specs=ACT)(
        table, mb["ids"]
    )
    return _loss(_dot("btd,de->bte", x, p["w"]))


def at_get(p, mb):
    return _loss(_dot("btd,de->bte", _embed(p, mb), p["w"]))


def embed_lookup(p, mb):
    x = pt.embed_lookup(p["embed"], mb["ids"], ACT)
    return _loss(_dot("btd,de->bte", x, p["w"]))


def one_hot_matmul(p, mb):
    onehot = jax.nn.one_hot(mb["ids"], VOCAB, dtype=jnp.float32)
    return _loss(_dot("btd,de->bte", _dot("btv,vd->btd", onehot, p["embed"]), p["w"]))


def bias_broadcast_param(p, mb):
    y = _dot("btd,de->bte", _embed(p, mb), p["w"])
    return _loss(y + pt.broadcast_param(p["b"], y))


def norm(p, mb):
    return _loss(_dot("btd,de->bte", _rms_norm(_embed(p, mb), p["scale"]), p["w"]))


def tied_embeddings(p, mb):
    logits = jnp.einsum("btd,vd->btv", _embed(p, mb), p["embed"], out_sharding=ACT)
    return _loss(logits)


def scanned_stack(p, mb):
    def layer(x, w):
        return x + jax.nn.gelu(_dot("btd,de->bte", x, w)), None

    x, _ = jax.lax.scan(layer, _embed(p, mb), p["stack"])
    return _loss(x)


def shard_map_carried_tag(p, mb):
    def kernel(w, x):
        # reduced -> varying is free; its transpose is varying -> unreduced.
        return x @ pt.to_varying(w, "data")

    w = p["w"]
    x = _embed(p, mb)
    y = jax.shard_map(kernel, in_specs=(pt.spec_of(w), ACT), out_specs=ACT)(w, x)
    return _loss(y)


def remat(p, mb):
    @jax.checkpoint
    def block(x, w, scale):
        return jax.nn.gelu(_dot("btd,de->bte", _rms_norm(x, scale), w))

    return _loss(block(_embed(p, mb), p["w"], p["scale"]))


@jax.custom_vjp
def _matmul(x, w):
    return _dot("btd,de->bte", x, w)


def _matmul_fwd(x, w):
    return _matmul(x, w), (x, w)


def _matmul_bwd(res, g):
    x, w = res
    # The weight gradient stays unreduced, as autodiff would leave it.
    dw_spec = P(None, None, unreduced={"data"})
    dw = jnp.einsum("btd,bte->de", x, g, out_sharding=dw_spec)
    return jnp.einsum("bte,de->btd", g, w, out_sharding=ACT), dw


_matmul.defvjp(_matmul_fwd, _matmul_bwd)


def custom_vjp(p, mb):
    return _loss(_matmul(_embed(p, mb), p["w"]))


# ---------------------------------------------------------------- tag-dropping idioms


def rebuilt_spec(p, mb):
    w = jax.reshard(p["w"], P(None, None))  # DROP
    return _loss(_dot("btd,de->bte", _embed(p, mb), w))


def bias_resharded(p, mb):
    y = _dot("btd,de->bte", _embed(p, mb), p["w"])
    return _loss(y + jax.reshard(p["b"], P()))  # DROP


def shard_map_untagged_in_spec(p, mb):
    def kernel(w, x):
        return x @ w

    # The in_spec P() only accepts an untagged value, so the tag goes here.
    w = jax.reshard(p["w"], P())  # DROP
    y = jax.shard_map(kernel, in_specs=(P(), ACT), out_specs=ACT)(w, _embed(p, mb))
    return _loss(y)


def used_twice(p, mb):
    x = _embed(p, mb)
    y = _dot("btd,de->bte", x, p["w"])
    z = _dot("btd,de->bte", y, jax.reshard(p["w"], P()))  # DROP
    return _loss(y + z)


SAFE = [
    take,
    at_get,
    embed_lookup,
    one_hot_matmul,
    bias_broadcast_param,
    norm,
    tied_embeddings,
    scanned_stack,
    shard_map_carried_tag,
    remat,
    custom_vjp,
]
# case -> the parameter whose gradient the dropped tag reduces in the loop
DROPPING = {
    rebuilt_spec: "w",
    bias_resharded: "b",
    shard_map_untagged_in_spec: "w",
    used_twice: "w",
}


def _drop_line(case):
    """'test_guard_corpus.py:LINE' of the line marked `# DROP` in `case`."""
    lines, first = inspect.getsourcelines(case)
    (offset,) = [i for i, line in enumerate(lines) if line.rstrip().endswith("# DROP")]
    return f"{os.path.basename(__file__)}:{first + offset}"


# ---------------------------------------------------------------- fixtures


class Corpus:
    """The data-sharded mesh, replicated parameters and a batch for every case."""

    def __init__(self):
        self.mesh = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Explicit,))
        rng = np.random.default_rng(0)
        shapes = {
            "embed": (VOCAB, DIM),
            "w": (DIM, DIM),
            "b": (DIM,),
            "scale": (DIM,),
            "stack": (LAYERS, DIM, DIM),
        }
        host = {k: (0.3 * rng.standard_normal(s)).astype(np.float32) for k, s in shapes.items()}
        ids = rng.integers(0, VOCAB, (BATCH, SEQ), dtype=np.int32)
        self.params = {k: jax.device_put(v, NamedSharding(self.mesh, P())) for k, v in host.items()}
        self.batch = {"ids": jax.device_put(ids, NamedSharding(self.mesh, P("data", None)))}

    def trace(self, loss_fn, on_tag_lost):
        def step(params, batch):
            return accum.accumulate_gradients(
                loss_fn, params, batch, num_microbatches=2, on_tag_lost=on_tag_lost
            )

        with jax.set_mesh(self.mesh):
            return jax.jit(step).trace(self.params, self.batch)

    def reduces_in_loop(self, loss_fn):
        """The compiled fact: a gradient-sized reduction inside the microbatch loop."""
        text = self.trace(loss_fn, "ignore").lower().compile().as_text()
        return bool(ht.in_loop_reductions(text))


@pytest.fixture(scope="module")
def corpus():
    return Corpus()


def _verdict(corpus, case):
    """The guard's verdict: the TagLostError message, or None when it passes."""
    try:
        corpus.trace(case, "raise")
    except TagLostError as error:
        return str(error)
    return None


# ---------------------------------------------------------------- tests


@pytest.mark.parametrize("case", SAFE, ids=lambda c: c.__name__)
def test_tag_safe_idiom_passes_and_compiles_without_in_loop_reduction(corpus, case):
    message = _verdict(corpus, case)
    assert message is None, message
    assert not corpus.reduces_in_loop(case)


@pytest.mark.parametrize("case", list(DROPPING), ids=lambda c: c.__name__)
def test_tag_dropping_idiom_raises_naming_parameter_and_line(corpus, case):
    message = _verdict(corpus, case)
    assert message is not None, "the guard passed a model that reduces in the loop"
    assert f"['{DROPPING[case]}']" in message
    assert "1 parameter(s)" in message  # no other parameter is blamed
    assert _drop_line(case) in message, message
    assert corpus.reduces_in_loop(case)


def test_at_get_model_gives_full_batch_gradients(corpus):
    """The issue's model: no error, and the accumulated gradients are the full-batch ones."""
    with jax.set_mesh(corpus.mesh):
        _, _, grads = jax.jit(
            lambda p, b: accum.accumulate_gradients(at_get, p, b, num_microbatches=4)
        )(corpus.params, corpus.batch)
        reference = jax.jit(jax.grad(lambda p, b: at_get(p, b)[0] / (BATCH * SEQ)))(
            corpus.params, corpus.batch
        )
    for key in ("embed", "w"):
        np.testing.assert_allclose(grads[key], reference[key], rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize(("case", "raises"), [(at_get, False), (bias_resharded, True)])
def test_start_add_finish_runs_the_same_guard(corpus, case, raises):
    def step(params, mb):
        acc = accum.start(case, params, mb)
        return accum.finish(accum.add(acc, case, params, mb))

    with jax.set_mesh(corpus.mesh):
        if raises:
            with pytest.raises(TagLostError, match=_drop_line(case)):
                jax.jit(step).trace(corpus.params, corpus.batch)
        else:
            jax.jit(step).trace(corpus.params, corpus.batch)
