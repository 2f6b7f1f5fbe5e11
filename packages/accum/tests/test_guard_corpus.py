"""The compiled verdict (accum.compile_checked), idiom by idiom.

Each case is a tiny `loss_fn` on a data-sharded explicit mesh. Tag-safe
idioms must compile without an error; tag-dropping ones must raise
`TagLostError` naming the parameter and a line of the case. For every case the
verdict must agree with hlo_tools' count of gradient-sized reductions inside
the loop. The tests/test_guard_generated.py corpus does the same for random
models against an oracle of its own.
"""

from __future__ import annotations

import inspect
import os
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
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


def integer_label_ce(p, mb):
    """The usual language-model loss (issue 33's false alarm): optax's
    integer-label cross-entropy picks the target with take_along_axis."""
    logits = jnp.einsum("btd,vd->btv", _embed(p, mb), p["embed"], out_sharding=ACT)
    losses = optax.softmax_cross_entropy_with_integer_labels(logits, mb["ids"])
    return jnp.sum(losses), {"weight": jnp.float32(losses.size)}


def l2_penalty(p, mb):
    """A parameter-only term in the loss next to a tagged table lookup (times the
    weight, as the loss contract asks: accum adds loss_sum once per microbatch)."""
    loss, aux = _loss(_dot("btd,de->bte", _embed(p, mb), p["w"]))
    return loss + 0.5 * jnp.sum(p["w"] * p["w"]) * aux["weight"], aux


# ---------------------------------------------------------------- tag-dropping idioms


def table_resharded_untagged(p, mb):
    table = jax.reshard(p["embed"], P(None, None))  # DROP: a spec rebuilt from rules
    x = table.at[mb["ids"]].get(out_sharding=ACT)
    return _loss(_dot("btd,de->bte", x, p["w"]))


def shard_map_psum_of_parameter(p, mb):
    def kernel(w, x):
        # A parameter-derived value made varying, then summed over data: the
        # transpose all-reduces w's whole gradient every microbatch.
        v = jax.lax.psum(pt.to_varying(w, "data") * 2.0, "data")  # DROP
        return x @ v

    w = p["w"]
    y = jax.shard_map(kernel, in_specs=(pt.spec_of(w), ACT), out_specs=ACT)(w, _embed(p, mb))
    return _loss(y)


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
    integer_label_ce,
    l2_penalty,
]
# case -> the parameter whose gradient the dropped tag reduces in the loop
DROPPING = {
    rebuilt_spec: "w",
    bias_resharded: "b",
    shard_map_untagged_in_spec: "w",
    used_twice: "w",
    table_resharded_untagged: "embed",
    shard_map_psum_of_parameter: "w",
}


def _case_lines(case):
    """'test_guard_corpus.py:LINE (name)' of each line of `case`: the source
    line XLA keeps for the reduction is one of them (the drop, or the use
    whose transpose reduces)."""
    lines, first = inspect.getsourcelines(case)
    return [
        f"{os.path.basename(__file__)}:{first + i} ({case.__name__})" for i in range(len(lines))
    ]


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

    def compile(self, loss_fn, on_tag_lost):
        def step(params, batch):
            return accum.accumulate_gradients(
                loss_fn, params, batch, num_microbatches=2, on_tag_lost=on_tag_lost
            )

        with jax.set_mesh(self.mesh):
            return accum.compile_checked(step, self.params, self.batch, on_tag_lost=on_tag_lost)


@pytest.fixture(scope="module")
def corpus():
    return Corpus()


def _verdict(corpus, case):
    """(TagLostError message or None, whether hlo_tools finds a gradient-sized
    reduction inside a loop): one compile, warned instead of raised."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        text = corpus.compile(case, "warn").as_text()
    messages = [str(w.message) for w in caught if "the compiled step" in str(w.message)]
    return (messages[0] if messages else None), bool(ht.in_loop_reductions(text))


# ---------------------------------------------------------------- tests


@pytest.mark.parametrize("case", SAFE, ids=lambda c: c.__name__)
def test_tag_safe_idiom_passes_and_compiles_without_in_loop_reduction(corpus, case):
    message, reduces_in_loop = _verdict(corpus, case)
    assert message is None, message
    assert not reduces_in_loop


@pytest.mark.parametrize("case", list(DROPPING), ids=lambda c: c.__name__)
def test_tag_dropping_idiom_raises_naming_parameter_and_line(corpus, case):
    message, reduces_in_loop = _verdict(corpus, case)
    assert message is not None, "the guard passed a model that reduces in the loop"
    blamed = [
        line.split("gradient of:")[1] for line in message.splitlines() if "gradient of:" in line
    ]
    # The parameter, and no other one.
    assert blamed and all(
        line.split(" (")[0].strip() == f"['{DROPPING[case]}']" for line in blamed
    ), message
    assert any(line in message for line in _case_lines(case)), message
    assert reduces_in_loop


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
    """The compiled `add` is checked like the loop: each call is one microbatch."""
    with jax.set_mesh(corpus.mesh):
        acc = jax.jit(accum.start, static_argnums=0)(case, corpus.params, corpus.batch)
        add = jax.jit(accum.add, static_argnums=1)
        if raises:
            with pytest.raises(
                TagLostError, match=r"^the gradient of \['b'\] .* per accum.add call [^\n]*$"
            ):
                accum.compile_checked(add, acc, case, corpus.params, corpus.batch)
        else:
            compiled = accum.compile_checked(add, acc, case, corpus.params, corpus.batch)
            acc = compiled(acc, corpus.params, corpus.batch)  # static loss_fn: compiled in
            assert int(acc.count) == 1


def test_integer_label_loss_raises_nothing(corpus):
    """compile_checked raises nothing on optax's integer-label loss (README)."""
    compiled = corpus.compile(integer_label_ce, "raise")
    assert not ht.in_loop_reductions(compiled.as_text())


def _trace_time_warns(corpus, case):
    """Whether tracing the accumulation of `case` in a plain jax.jit warns (no compile)."""

    def step(params, batch):
        return accum.accumulate_gradients(case, params, batch, num_microbatches=2)

    with jax.set_mesh(corpus.mesh), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        jax.jit(step).trace(corpus.params, corpus.batch)
    return [str(w.message) for w in caught if "trace-time analysis" in str(w.message)]


def test_trace_time_analysis_on_the_corpus(corpus):
    """Inside a user's own jit: no warning on a tag-safe idiom (take_along_axis's
    scatter-add back into batch-sharded rows is local), a warning naming the
    parameter on each dropping one (a parameter psum'd inside shard_map: in the
    forward pass), except a table resharded untagged before `.at[].get`: its
    jaxpr all-gathers the cotangent and scatter-adds locally; the all-reduce is
    XLA's rewrite, which only the compiled verdict sees."""
    for case in SAFE:
        assert not _trace_time_warns(corpus, case), case.__name__
    for case, name in DROPPING.items():
        if case is table_resharded_untagged:
            continue
        warned = _trace_time_warns(corpus, case)
        assert warned and f"['{name}']" in warned[0], (case.__name__, warned)
