"""mu_dtype / nu_dtype: AdamW's moments stored in their own dtypes (step/adam_moments.py).

float32 is optax.adamw bit for bit; bf16 rounds once per step and stays within bf16
rounding of float32; the config refuses a bf16 moment whose decay would round away;
the trained state holds the moments in their dtype and in the parameters' sharding
(ZeRO-1's shards too), and the compiled step's arguments shrink by exactly their bytes.
"""

import doctest

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from trainer.config import ConfigError, make_config
from trainer.config.validate import MIN_BF16_DECAY, validate
from trainer.run import aot
from trainer.run import run as run_lib
from trainer.step import adam_moments
from trainer.step.optimizer import learning_rate_schedule, make_optimizer

BF16 = {"mu_dtype": "bfloat16", "nu_dtype": "bfloat16"}


def _tree(seed, scale=1.0):
    keys = jax.random.split(jax.random.key(seed), 2)
    return {
        "w": scale * jax.random.normal(keys[0], (8, 16)),
        "b": {"v": scale * jax.random.normal(keys[1], (16,))},
    }


def _steps(tx, steps=4):
    """[(updates, state)] after each of `steps` updates of random gradients."""
    params = _tree(0)
    state = tx.init(params)
    out = []
    for i in range(steps):
        updates, state = jax.jit(tx.update)(_tree(i + 1, 0.1), state, params)
        params = optax.apply_updates(params, updates)
        out.append((updates, state))
    return out


def _adam(state):
    (adam,) = [
        n for n in jax.tree.leaves(state, is_leaf=lambda n: hasattr(n, "nu")) if hasattr(n, "nu")
    ]
    return adam


def test_docstring_example_runs():
    assert doctest.testmod(adam_moments, raise_on_error=True).attempted > 0


def test_state_dtypes_follow_the_keys():
    params = _tree(0)
    for mu, nu in (("", ""), ("bfloat16", ""), ("", "bfloat16"), ("bfloat16", "float32")):
        training = make_config({"mu_dtype": mu, "nu_dtype": nu}).training
        adam = _adam(make_optimizer(training).init(params))
        assert {str(x.dtype) for x in jax.tree.leaves(adam.mu)} == {mu or "float32"}
        assert {str(x.dtype) for x in jax.tree.leaves(adam.nu)} == {nu or "float32"}
    # '' is the parameters' dtype: bf16 parameters, bf16 moments.
    adam = _adam(make_optimizer(make_config().training).init(jax.tree.map(jnp.bfloat16, params)))
    assert {x.dtype for x in jax.tree.leaves((adam.mu, adam.nu))} == {jnp.dtype(jnp.bfloat16)}


def test_float32_moments_are_optax_adamw_bit_for_bit():
    training = make_config({"mu_dtype": "float32", "nu_dtype": "float32", "steps": "8"}).training
    ours = _steps(make_optimizer(training))
    theirs = _steps(
        optax.chain(
            optax.clip_by_global_norm(training.gradient_clipping_threshold),
            optax.adamw(
                learning_rate_schedule(training),
                b1=training.adam_b1,
                b2=training.adam_b2,
                eps=training.adam_eps,
                weight_decay=training.adam_weight_decay,
            ),
        )
    )
    for (u, s), (u_ref, s_ref) in zip(ours, theirs, strict=True):
        # The same tree (a checkpoint's array names) and the same bits.
        assert jax.tree.structure(s) == jax.tree.structure(s_ref)
        for got, want in zip(jax.tree.leaves((u, s)), jax.tree.leaves((u_ref, s_ref)), strict=True):
            np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_bf16_moments_round_once_and_track_float32():
    f32 = _steps(adam_moments.scale_by_adam_moments(b2=0.95), steps=5)
    bf16 = _steps(
        adam_moments.scale_by_adam_moments(b2=0.95, mu_dtype="bfloat16", nu_dtype="bfloat16"),
        steps=5,
    )
    # Step 1 starts from zeros in both: the stored moments are float32's, rounded once.
    (u1, s1), (u1_ref, s1_ref) = bf16[0], f32[0]
    stored, reference = (s1.mu, s1.nu), (s1_ref.mu, s1_ref.nu)
    for got, want in zip(jax.tree.leaves(stored), jax.tree.leaves(reference), strict=True):
        assert got.dtype == jnp.bfloat16
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want.astype(jnp.bfloat16)))
    # ... and its update is computed before that rounding: float32's exactly.
    for got, want in zip(jax.tree.leaves(u1), jax.tree.leaves(u1_ref), strict=True):
        assert got.dtype == jnp.float32
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    # Later steps: within a few bf16 spacings (2^-8 relative) of float32's updates.
    bf16_spacing = 2.0**-8
    for (u, _), (u_ref, _) in zip(bf16[1:], f32[1:], strict=True):
        for got, want in zip(jax.tree.leaves(u), jax.tree.leaves(u_ref), strict=True):
            np.testing.assert_allclose(got, want, rtol=4 * bf16_spacing, atol=4 * bf16_spacing)
            assert not np.array_equal(np.asarray(got), np.asarray(want))  # bf16 did round


def _positive_normal_bf16(lowest_exponent=1):
    """Every positive normal bf16 value from 2^(lowest_exponent - 127) up."""
    bits = np.arange(lowest_exponent << 7, 0x7F80, dtype=np.uint16)  # exponent .. 254
    return jnp.asarray(bits.view(jnp.bfloat16))


@pytest.mark.parametrize("decay", [MIN_BF16_DECAY, 0.05])
def test_bf16_decay_at_or_above_the_threshold_lowers_every_value(decay):
    m = _positive_normal_bf16()
    decayed = ((1 - decay) * m.astype(jnp.float32)).astype(jnp.bfloat16)
    assert bool(jnp.all(decayed < m))


def test_bf16_decay_below_the_threshold_is_lost_even_computed_in_float32():
    # From the second binade: XLA:CPU flushes a product below the normals to zero.
    m = _positive_normal_bf16(lowest_exponent=2)
    for beta in (0.999, 1 - MIN_BF16_DECAY / 2):
        decayed = (beta * m.astype(jnp.float32)).astype(jnp.bfloat16)
        assert bool(jnp.all(decayed == m)), beta  # b2 x nu rounds back to nu: no decay
    # The transformation with b2 = 0.999: zero gradients leave a bf16 nu where it was.
    tx = adam_moments.scale_by_adam_moments(b2=0.999, nu_dtype="bfloat16")
    state = tx.init({"w": jnp.zeros(4)})
    _, state = tx.update({"w": jnp.full(4, 3.0)}, state)
    nu = state.nu["w"]
    for _ in range(3):
        _, state = tx.update({"w": jnp.zeros(4)}, state)
    np.testing.assert_array_equal(state.nu["w"], nu)


def test_bad_values_are_refused_naming_the_key():
    with pytest.raises(ConfigError, match=r"^mu_dtype='int8' is not one of"):
        make_config({"mu_dtype": "int8"})
    with pytest.raises(ConfigError, match=r"^nu_dtype='float64' is not one of"):
        make_config({"nu_dtype": "float64"})
    with pytest.raises(ConfigError, match=r"^nu_dtype=bfloat16 and adam_b2=0.999: .* never decays"):
        validate(make_config({"nu_dtype": "bfloat16", "adam_b2": "0.999"}), 8)
    with pytest.raises(ConfigError, match=r"^mu_dtype=bfloat16 and adam_b1=0.999"):
        validate(make_config({"mu_dtype": "bfloat16", "adam_b1": "0.999"}), 8)
    # '' follows the weights: bf16 weights with b2=0.999 need nu_dtype=float32.
    bf16_weights = {"weight_dtype": "bfloat16", "adam_b2": "0.999"}
    with pytest.raises(ConfigError, match=r"^nu_dtype='' with weight_dtype=bfloat16 and adam"):
        validate(make_config(bf16_weights), 8)
    validate(make_config({**bf16_weights, "nu_dtype": "float32"}), 8)
    validate(make_config({**BF16, "adam_b1": str(1 - MIN_BF16_DECAY)}), 8)
    assert make_config({"model_name": "deepseek3-h200"}).nu_dtype == "bfloat16"


# The trained tiny model on 8 CPU devices, ZeRO-1 (moments sharded over 'data' with the
# master parameters): float32 moments against bf16 ones, compiled once each.
ZERO1 = {
    "model_name": "tagtrain-tiny",
    "ici_data_parallelism": "8",
    "shard_optimizer_over_data": "true",
    "per_device_batch_size": "1",
    "steps": "3",
}


@pytest.fixture(scope="module")
def trained():
    out = {}
    for name, extra in (("f32", {}), ("bf16", BF16)):
        run = run_lib.setup(make_config({**ZERO1, **extra}))
        run_lib.compile_step(run)
        out[name] = (run, run_lib.train(run))
    return out


def _moment_leaves(run):
    adam = _adam(run.state["opt_state"])
    return jax.tree.leaves(adam.mu), jax.tree.leaves(adam.nu)


def test_trained_moments_keep_their_dtype_and_the_parameters_sharding(trained):
    for name, dtype in (("f32", jnp.float32), ("bf16", jnp.bfloat16)):
        run, _ = trained[name]
        params = jax.tree.leaves(run.state["params"])  # ZeRO-1's data-sharded masters
        assert any("data" in str(p.sharding.spec) for p in params)
        for moments in _moment_leaves(run):
            for m, p in zip(moments, params, strict=True):
                assert m.dtype == dtype, name
                assert m.sharding.is_equivalent_to(p.sharding, p.ndim), (name, m.sharding)
    losses = [[h["loss"] for h in trained[n][1]] for n in ("f32", "bf16")]
    np.testing.assert_allclose(losses[1], losses[0], rtol=1e-2)


def test_compiled_memory_shrinks_by_the_moments_bytes(trained):
    """The compiled step's arguments (compiled.memory_analysis(), the report's
    `argument` line) lose exactly the bytes bf16 moments save on one device."""

    def per_device(run):
        return sum(m.addressable_shards[0].data.nbytes for ms in _moment_leaves(run) for m in ms)

    f32_run, bf16_run = trained["f32"][0], trained["bf16"][0]
    f32_moments, bf16_moments = per_device(f32_run), per_device(bf16_run)
    assert f32_moments == 2 * bf16_moments > 0
    f32_mem, bf16_mem = aot.memory_of(f32_run.compiled), aot.memory_of(bf16_run.compiled)
    assert f32_mem["argument"] - bf16_mem["argument"] == f32_moments - bf16_moments
