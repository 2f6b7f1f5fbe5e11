"""Common JAX / optax idioms against accum's loss contract: each either gives the
full batch's loss and gradients (num_microbatches=2 equal to 1 and to `jax.grad`
over the whole batch) or is refused (or warned about) at trace time, naming the
key: never a silently different result. docs/accum.md, "The loss contract"."""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import accum

ROWS = 16
X = jax.random.normal(jax.random.key(0), (ROWS, 4))
Y = jax.random.normal(jax.random.key(1), (ROWS,))
W = {"w": jnp.linspace(0.5, 1.5, 4)}
B = {"x": X, "y": Y}


def _sq(p, mb):
    return (mb["x"] @ p["w"] - mb["y"]) ** 2


def _rows(mb):
    return {"weight": jnp.float32(mb["x"].shape[0])}


@pytest.fixture(scope="module")
def mesh():
    return jax.make_mesh((8,), ("data",), axis_types=(AxisType.Explicit,))


def _trace(loss_fn, params, batch, n=2, mesh=None, path="auto", **kw):
    """Trace accumulate_gradients (no compile): where the checks raise or warn."""

    def step(p, b):
        plan = accum.plan_for(p, b, path=path) if mesh is not None else None
        return accum.accumulate_gradients(loss_fn, p, b, num_microbatches=n, plan=plan, **kw)

    if mesh is None:
        return jax.eval_shape(step, params, batch)
    with jax.set_mesh(mesh):
        params = jax.device_put(params, NamedSharding(mesh, P()))
        rows = lambda x: P("data") if jnp.ndim(x) and x.shape[0] == ROWS else P()  # noqa: E731
        batch = jax.tree.map(lambda x: jax.device_put(x, NamedSharding(mesh, rows(x))), batch)
        return jax.eval_shape(step, params, batch)


def _run(loss_fn, params, batch, n, **kw):
    return jax.jit(
        lambda p, b: accum.accumulate_gradients(loss_fn, p, b, num_microbatches=n, **kw)
    )(params, batch)


def _assert_full_batch(loss_fn, params, batch, **kw):
    """n=2 equals n=1 and jax.grad of the whole batch's sum over its weight."""
    grad = jax.value_and_grad(loss_fn, has_aux=True, allow_int=True)
    (total, aux), grads = grad(params, batch)
    weight = jnp.asarray(aux["weight"], jnp.float32)
    for n in (1, 2):
        loss, _, got = _run(loss_fn, params, batch, n, **kw)
        np.testing.assert_allclose(loss, total / weight, rtol=1e-5)
        leaves = (jax.tree.leaves(got), jax.tree.leaves(grads), jax.tree.leaves(params))
        pairs = zip(*leaves, strict=True)
        for g, want, p in pairs:
            if want.dtype == jax.dtypes.float0:  # an integer leaf: zeros of its own dtype
                assert g.dtype == p.dtype and not np.any(g)
                continue
            assert g.dtype == jnp.promote_types(want.dtype, jnp.float32)
            np.testing.assert_allclose(g, want / weight.astype(want.dtype), rtol=1e-5, atol=1e-6)


# ------------------------------------------------------------------ refused or warned


def mean_over_rows(p, mb):  # jnp.mean beside a weight that counts the rows
    return jnp.mean(_sq(p, mb)), _rows(mb)


def masked_mean(p, mb):  # sum / mask.sum() beside weight = mask.sum()
    m = mb["m"]
    return jnp.sum(_sq(p, mb) * m) / jnp.maximum(m.sum(), 1.0), {"weight": m.sum()}


def optax_mean(p, mb):  # optax's per-example losses, .mean(), inside a checkpoint
    logits = jnp.stack([mb["x"] @ p["w"], -mb["x"] @ p["w"]], axis=-1)
    labels = (mb["y"] > 0).astype(jnp.int32)
    ce = jax.checkpoint(lambda lg: optax.softmax_cross_entropy_with_integer_labels(lg, labels))
    return ce(logits).mean().astype(jnp.float32), _rows(mb)


def sum_times_reciprocal(p, mb):  # the division spelled as a product, literal on the right
    return jnp.sum(_sq(p, mb)) * (1.0 / mb["x"].shape[0]), _rows(mb)


def reciprocal_times_sum(p, mb):  # ... on the left
    return (1.0 / mb["x"].shape[0]) * jnp.sum(_sq(p, mb)), _rows(mb)


def masked_reciprocal(p, mb):  # times 1 / mask.sum()
    m = mb["m"]
    return jnp.sum(_sq(p, mb) * m) * (1.0 / jnp.maximum(m.sum(), 1.0)), {"weight": m.sum()}


def divided_inside_the_sum(p, mb):  # each row's loss divided by the count, then summed
    m = mb["m"]
    return jnp.sum(_sq(p, mb) * m / m.sum()), {"weight": m.sum()}


def times_negative_power(p, mb):  # count ** -1, jnp.reciprocal(count)
    m = mb["m"]
    return jnp.sum(_sq(p, mb) * m) * jnp.reciprocal(m.sum()), {"weight": m.sum()}


def each_row_over_rows(p, mb):  # sum(l / rows)
    return jnp.sum(_sq(p, mb) / mb["x"].shape[0]), _rows(mb)


def dot_with_normalized_mask(p, mb):  # l @ (m / m.sum())
    m = mb["m"]
    return _sq(p, mb) @ (m / m.sum()), {"weight": m.sum()}


def mean_plus_penalty(p, mb):  # a mean term beside the README's penalty-times-weight term
    penalty = 1e-3 * jnp.sum(p["w"] ** 2) * jnp.float32(mb["x"].shape[0])
    return jnp.mean(_sq(p, mb)) + penalty, _rows(mb)


def nan_mean(p, mb):  # jnp.nanmean: divided by the count of non-NaN losses
    return jnp.nanmean(_sq(p, mb)), _rows(mb)


def divided_by_a_traced_count(p, mb):  # rows * 1.0: arithmetic the trace keeps as equations
    return jnp.sum(_sq(p, mb)) / (jnp.float32(mb["x"].shape[0]) * 1.0), _rows(mb)


@pytest.mark.parametrize("where", ["no_mesh", "local_path"])
@pytest.mark.parametrize(
    "loss_fn",
    [
        divided_by_a_traced_count,
        nan_mean,
        mean_over_rows,
        masked_mean,
        optax_mean,
        sum_times_reciprocal,
        reciprocal_times_sum,
        masked_reciprocal,
        mean_plus_penalty,
        divided_inside_the_sum,
        times_negative_power,
        each_row_over_rows,
        dot_with_normalized_mask,
    ],
)
def test_a_mean_as_loss_sum_is_refused(loss_fn, where, mesh):
    batch = {**B, "m": (jnp.arange(ROWS) % 3 != 0).astype(jnp.float32)}
    kw = {"mesh": mesh, "path": "local"} if where == "local_path" else {}
    with pytest.raises(ValueError, match=r"loss_sum is a mean: it is divided by"):
        _trace(loss_fn, W, batch, **kw)


def l2_added(p, mb):  # the parameters' L2 penalty added as it is
    return jnp.sum(_sq(p, mb)) + 0.5 * jnp.sum(p["w"] * p["w"]), _rows(mb)


def l2_subtracted_beside_a_mask(p, mb):  # subtracted, beside weight = mask.sum()
    m = mb["m"]
    return jnp.sum(_sq(p, mb) * m) - (-1e-3) * jnp.sum(p["w"] ** 2), {"weight": m.sum()}


def l2_in_a_jitted_helper(p, mb):  # the penalty computed by a jitted helper, no literal
    penalty = jax.jit(lambda w: jnp.sum(jnp.abs(w)))(p["w"])
    return jnp.sum(_sq(p, mb)) + penalty, _rows(mb)


@pytest.mark.parametrize("where", ["no_mesh", "local_path"])
@pytest.mark.parametrize("loss_fn", [l2_added, l2_subtracted_beside_a_mask, l2_in_a_jitted_helper])
def test_a_parameter_term_added_without_the_weight_is_refused(loss_fn, where, mesh):
    """A term of the parameters alone added to loss_sum would count once per microbatch
    (and device): N times the full batch's."""
    batch = {**B, "m": (jnp.arange(ROWS) % 3 != 0).astype(jnp.float32)}
    kw = {"mesh": mesh, "path": "local"} if where == "local_path" else {}
    with pytest.raises(ValueError, match=r"adds a term computed from the parameters alone"):
        _trace(loss_fn, W, batch, **kw)


@pytest.mark.parametrize("weighted", ["constant_chain", "mask_sum", "times_zero"])
def test_a_parameter_term_times_the_weight_passes(weighted):
    """Times a row count fixed at trace time (through arithmetic the trace keeps, as in
    `1e-2 * weight * 0.5 * l2`), times a count computed from the batch, or times 0:
    the full batch's numbers, not refused."""
    batch = {**B, "m": (jnp.arange(ROWS) % 3 != 0).astype(jnp.float32)}

    def loss_fn(p, mb):
        l2 = jnp.sum(p["w"] * p["w"])
        if weighted == "mask_sum":
            m = mb["m"]
            return jnp.sum(_sq(p, mb) * m) + 1e-2 * l2 * m.sum(), {"weight": m.sum()}
        if weighted == "times_zero":
            return jnp.sum(_sq(p, mb)) + 0.0 * l2, _rows(mb)
        weight = _rows(mb)["weight"]
        return jnp.sum(_sq(p, mb)) + 1e-2 * weight * 0.5 * l2, {"weight": weight}

    _assert_full_batch(loss_fn, W, batch)


def test_a_per_sequence_mean_is_a_sum_over_rows_and_passes():
    """Divided by the sequence length (not by the rows): a sum over rows, not refused."""
    batch = {"x": jnp.stack([X, X + 1.0], axis=1), "y": jnp.stack([Y, -Y], axis=1)}

    def per_sequence_mean(p, mb):
        per_token = (jnp.einsum("btd,d->bt", mb["x"], p["w"]) - mb["y"]) ** 2
        return jnp.sum(per_token) / mb["x"].shape[1], _rows(mb)

    _assert_full_batch(per_sequence_mean, W, batch)


def test_a_per_example_aux_value_is_refused(mesh):
    def per_example(p, mb):
        return jnp.sum(_sq(p, mb)), {**_rows(mb), "per": _sq(p, mb)}

    with pytest.raises(ValueError, match=r"aux\['per'\] has shape \(8,\), a row per example"):
        _trace(per_example, W, B)
    with pytest.raises(ValueError, match=r"aux\['per'\] has shape \(8,\), a row per example"):
        _trace(per_example, W, B, mesh=mesh, path="local")


def test_a_per_example_aux_value_on_a_later_dimension_is_refused():
    """Checked where the probe traces twice anyway (here for the Python-int weight):
    a later dimension that equals the rows (an expert count) must not cost every
    step a second trace of the model."""

    def per_example(p, mb):
        return jnp.sum(_sq(p, mb)), {"weight": mb["x"].shape[0], "per": _sq(p, mb)[None]}

    with pytest.raises(ValueError, match=r"aux\['per'\] has shape \(1, 8\), a row per example"):
        _trace(per_example, W, B)


def test_a_per_row_normalization_inside_the_sum_passes():
    """Each sequence's losses divided by its own token count, then summed over rows: a
    sum of per-row means (weight = rows), not a mean over the microbatch."""
    batch = {"x": jnp.stack([X, X + 1.0], axis=1), "y": jnp.stack([Y, -Y], axis=1)}

    def per_row_mean(p, mb):
        per_token = (jnp.einsum("btd,d->bt", mb["x"], p["w"]) - mb["y"]) ** 2
        tokens = jnp.ones_like(per_token)
        return jnp.sum(per_token / tokens.sum(-1, keepdims=True)), _rows(mb)

    _assert_full_batch(per_row_mean, W, batch)


def test_a_sum_scaled_by_constants_passes():
    """A fixed scale (0.5 x sum), or a penalty times the weight (a term that grows with
    the rows): sums over the rows, not refused, the full batch's numbers."""

    def scaled(p, mb):
        penalty = 1e-3 * jnp.sum(p["w"] ** 2) * jnp.float32(mb["x"].shape[0])
        return 0.5 * jnp.sum(_sq(p, mb)) + penalty, _rows(mb)

    _assert_full_batch(scaled, W, B)


def test_a_non_number_aux_value_is_one_line():
    def named(p, mb):
        return jnp.sum(_sq(p, mb)), {**_rows(mb), "name": "run-1"}

    with pytest.raises(TypeError, match=r"aux\['name'\] is a str \('run-1'\)"):
        _trace(named, W, B)


def test_a_constant_aux_value_warns():
    def logs_lr(p, mb):
        return jnp.sum(_sq(p, mb)), {**_rows(mb), "lr": 0.5}

    with pytest.warns(RuntimeWarning, match=r"aux\['lr'\] is the constant 0.5 for any rows"):
        _trace(logs_lr, W, B)


def _dropped(p, mb, key):
    keep = jax.random.bernoulli(key, 0.5, mb["x"].shape)
    return jnp.sum(((mb["x"] * keep) @ p["w"] - mb["y"]) ** 2), _rows(mb)


def test_a_prng_key_batch_leaf_warns():
    with pytest.warns(RuntimeWarning, match=r"batch leaf \['k'\] is a 0-d PRNG key.*rng="):
        _trace(lambda p, mb: _dropped(p, mb, mb["k"]), W, {**B, "k": jax.random.key(3)})


def test_a_closed_over_prng_key_warns():
    """Closed over (a jitted step's argument), the key is the same in every microbatch."""

    def step(p, b, key):
        return accum.accumulate_gradients(
            lambda p, mb: _dropped(p, mb, key), p, b, num_microbatches=2
        )

    with pytest.warns(RuntimeWarning, match=r"closes over 1 PRNG key\(s\) \(key<fry>\[\]\)"):
        jax.eval_shape(step, W, B, jax.random.key(3))
    with warnings.catch_warnings():  # passed as rng=: folded per microbatch, no warning
        warnings.simplefilter("error")
        _trace(_dropped, W, B, rng=jax.random.key(3))


@pytest.mark.parametrize(
    ("extra", "named"),
    [(jnp.ones((1, 4)), r"\['s'\] has 1"), (jax.random.PRNGKey(3), r"\['s'\] has 2")],
    ids=["broadcast_row", "legacy_prng_key"],
)
def test_a_leaf_without_rows_is_named(extra, named, mesh):
    def loss(p, mb):
        return jnp.sum(_sq(p, mb)), _rows(mb)

    match = r"disagree on the leading \(batch\) dimension: .*" + named
    with pytest.raises(ValueError, match=match):
        _trace(loss, W, {**B, "s": extra})
    # The local path named nothing (a shard_map error) before.
    with pytest.raises(ValueError, match=match):
        _trace(loss, W, {**B, "s": extra}, mesh=mesh, path="local")


# ------------------------------------------------------------------ the full batch's result


def test_a_complex_parameter_keeps_its_imaginary_gradient():
    """accum_dtype=f32 accumulated a complex64 gradient in f32 (imaginary part dropped)."""

    def loss(p, mb):
        z = mb["x"] @ p["w"] + 1j * p["c"] - mb["y"]
        return jnp.sum(jnp.abs(z) ** 2), _rows(mb)

    params = {**W, "c": jnp.complex64(0.5 + 0.25j)}
    _assert_full_batch(loss, params, B)
    assert _run(loss, params, B, 2)[2]["c"].dtype == jnp.complex64


def test_the_local_path_keeps_a_bool_parameter_bool(mesh):
    def loss(p, mb):
        return jnp.sum(_sq(p, mb)) * p["on"].astype(jnp.float32), _rows(mb)

    params = {**W, "on": jnp.bool_(True), "none": None}
    for path in ("tags", "local"):
        grads = _trace(loss, params, B, mesh=mesh, path=path)[2]
        assert grads["on"].dtype == jnp.bool_, path


def _masked(p, mb):
    m = mb["m"]  # bool mask: its sum is an int32 weight
    return jnp.sum(_sq(p, mb) * m), {"weight": m.sum()}


def _python_int_weight(p, mb):
    return jnp.sum(_sq(p, mb)) * mb["t"], {"weight": mb["x"].shape[0]}


def _signed(p, mb):
    return jnp.sum(_sq(p, mb) * mb["s"]), {"weight": jnp.sum(mb["s"])}


def _frozen(p, mb):
    w = p["w"] + jax.lax.stop_gradient(p["v"]) * p["step"]
    return jnp.sum((mb["x"] @ w - mb["y"]) ** 2), _rows(mb)


@pytest.mark.parametrize(
    ("loss_fn", "params", "batch"),
    [
        # microbatch 0 holds the even rows: with every even row masked it weighs 0
        (_masked, W, {**B, "m": jnp.arange(ROWS) % 2 == 1}),
        (_python_int_weight, W, {**B, "t": jnp.float32(2.0)}),  # a 0-d leaf, an int weight
        (_frozen, {**W, "v": jnp.ones(4), "step": jnp.int32(3), "none": None}, B),
        # signed weights summing below zero: divided as the full batch is, not zeroed
        (_signed, W, {**B, "s": jnp.where(jnp.arange(ROWS) < 12, -1.0, 1.0)}),
    ],
    ids=[
        "zero_weight_microbatch_bool_mask",
        "python_int_weight_0d_leaf",
        "frozen_int_none",
        "negative_total_weight",
    ],
)
def test_idioms_that_give_the_full_batch(loss_fn, params, batch):
    _assert_full_batch(loss_fn, params, batch)


@pytest.mark.parametrize("key", [jax.random.key(5), jax.random.PRNGKey(5)], ids=["key", "uint32"])
def test_both_key_kinds_fold_per_microbatch(key):
    """`rng=` as a typed key or a legacy uint32 PRNGKey: microbatch i gets fold_in(rng, i)."""

    def noisy(p, mb, rng):
        return jnp.sum(_sq(p, mb) * jax.random.uniform(rng)), _rows(mb)

    loss, _, _ = _run(noisy, W, B, 2, rng=key)
    want = sum(
        jnp.sum(_sq(W, jax.tree.map(lambda x, i=i: x[i::2], B)))
        * jax.random.uniform(jax.random.fold_in(key, i))
        for i in range(2)
    )
    np.testing.assert_allclose(loss, want / ROWS, rtol=1e-5)


def test_an_array_constant_in_aux_is_a_count_and_summed_silently():
    """`jnp.float32(1)` per microbatch (the trainer's balance_loss_terms) is meant to be
    summed: no warning, and it comes back as the number of microbatches."""

    def counts_calls(p, mb):
        return jnp.sum(_sq(p, mb)), {**_rows(mb), "calls": jnp.float32(1)}

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _, aux, _ = _run(counts_calls, W, B, 2)
    assert float(aux["calls"]) == 2.0


def test_start_refuses_a_mean_as_accumulate_gradients_does():
    with pytest.raises(ValueError, match=r"loss_sum is a mean"):
        jax.eval_shape(lambda p, mb: accum.start(mean_over_rows, p, mb), W, B)


def test_a_prng_key_among_the_params_is_named():
    """An nnx model's whole state (`nnx.split(model)`) holds its Rngs' keys: named, not
    JAX's "Cannot determine dtype of key<fry>"."""
    params = {**W, "rngs": {"dropout": {"key": jax.random.key(0)}}}

    def loss(p, mb):
        return jnp.sum(_sq(p, mb)), _rows(mb)

    with pytest.raises(TypeError, match=r"params leaf \['rngs'\]\['dropout'\]\['key'\] is a PRNG"):
        _trace(loss, params, B)
