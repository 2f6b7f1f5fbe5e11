"""Architecture options (issue 30): YaRN, interleaved RoPE, q_lora_rank=0, their config
errors. The formulas are checked against numpy written from DeepSeek's description."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from trainer import model as model_lib
from trainer.config import PRESETS, ConfigError, hf_map, make_config
from trainer.config.validate import check_architecture, validate
from trainer.model import flops
from trainer.model import rope as rope_lib
from trainer.sharding import ShardCtx, logical_rules, make_mesh

V3_YARN = dict(
    rope_type="yarn",
    rope_factor=40.0,
    original_max_position_embeddings=4096,
    beta_fast=32.0,
    beta_slow=1.0,
    rope_max_timescale=10_000,
    qk_rope_head_dim=64,
    qk_nope_head_dim=128,
)


def _m(scale, k):
    return 0.1 * k * math.log(scale) + 1.0


def _numpy_yarn(rope_dim, theta, factor, original, beta_fast, beta_slow, truncate=True):
    """YaRN's frequencies, written out from the formula in issue 30."""

    def bound(beta):
        return rope_dim * math.log(original / (beta * 2 * math.pi)) / (2 * math.log(theta))

    low, high = bound(beta_fast), bound(beta_slow)
    if truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, rope_dim - 1)
    freqs = []
    for i in range(rope_dim // 2):
        inv = theta ** (-2.0 * i / rope_dim)
        t = min(max((i - low) / max(high - low, 1e-3), 0.0), 1.0)  # 0: keep, 1: interpolate
        freqs.append((1 - t) * inv + t * inv / factor)
    return np.array(freqs), (low, high)


@pytest.mark.parametrize("truncate", [True, False])
def test_yarn_frequencies_match_the_formula(truncate):
    config = make_config({**V3_YARN, "rope_truncate": truncate})
    want, bounds = _numpy_yarn(64, 10_000, 40.0, 4096, 32.0, 1.0, truncate)
    if truncate:
        assert bounds == (10, 23)  # DeepSeek-V3's ramp over pair indices 10..23
    assert rope_lib.yarn_ramp_bounds(config) == pytest.approx(bounds)
    np.testing.assert_allclose(rope_lib.yarn_frequencies(config), want, rtol=1e-6)
    # Fast-turning pairs keep their frequency, slow ones are divided by the factor.
    assert rope_lib.yarn_frequencies(config)[0] == 1.0
    np.testing.assert_allclose(
        rope_lib.yarn_frequencies(config)[-1], 10_000 ** (-62 / 64) / 40, rtol=1e-6
    )


@pytest.mark.parametrize(
    "mscale,mscale_all_dim,attention_scaling,want_qk,want_softmax_m",
    [
        # V3 (1.0 / 1.0) and V2-Lite (0.707 / 0.707): q/k unscaled, softmax x m^2.
        (1.0, 1.0, False, 1.0, 1.0),
        (0.707, 0.707, False, 1.0, 0.707),
        # MaxText's one key: mscale_all_dim left at -1 means "the same as mscale".
        (0.707, -1.0, False, 1.0, 0.707),
        # HF with mscale_all_dim absent (0): q/k x m(s, mscale), softmax unchanged.
        (1.0, 0.0, False, _m(40, 1.0), 0.0),
        (0.5, 1.0, False, _m(40, 0.5) / _m(40, 1.0), 1.0),
        # MaxText's rope_attention_scaling: another m(s, 1) on q/k.
        (1.0, 1.0, True, _m(40, 1.0), 1.0),
    ],
)
def test_yarn_magnitude_and_softmax_scale(
    mscale, mscale_all_dim, attention_scaling, want_qk, want_softmax_m
):
    config = make_config(
        {
            **V3_YARN,
            "mscale": mscale,
            "mscale_all_dim": mscale_all_dim,
            "rope_attention_scaling": attention_scaling,
        }
    )
    assert rope_lib.output_scale(config) == pytest.approx(want_qk, rel=1e-12)
    want_softmax = 192**-0.5 * _m(40, want_softmax_m) ** 2
    assert rope_lib.softmax_scale(config) == pytest.approx(want_softmax, rel=1e-12)


def test_plain_rope_scales_nothing():
    config = make_config({"mscale": 0.5, "rope_attention_scaling": True})  # default rope
    assert rope_lib.output_scale(config) == 1.0
    assert rope_lib.softmax_scale(config) == config.qk_head_dim**-0.5


@pytest.mark.parametrize("interleave", [False, True])
def test_rope_rotates_the_right_pairs_by_the_yarn_angles(interleave):
    config = make_config(
        {**V3_YARN, "qk_rope_head_dim": 8, "mscale": 0.5, "rope_interleave": interleave}
    )
    rng = np.random.default_rng(0)
    x = rng.standard_normal((2, 5, 3, 8)).astype(np.float32)
    positions = np.tile(np.arange(5, dtype=np.int32) * 7, (2, 1))
    got = np.asarray(rope_lib.rope(jnp.asarray(x), jnp.asarray(positions), config))
    freqs, _ = _numpy_yarn(8, 10_000, 40.0, 4096, 32.0, 1.0)
    pairs = [(2 * i, 2 * i + 1) if interleave else (i, i + 4) for i in range(4)]
    want = np.empty_like(x, dtype=np.float64)
    for i, (a, b) in enumerate(pairs):
        angle = positions[:, :, None] * freqs[i]
        c, s = np.cos(angle), np.sin(angle)
        want[..., a] = x[..., a] * c - x[..., b] * s
        want[..., b] = x[..., b] * c + x[..., a] * s
    # mscale_all_dim unset (-1): equal to mscale, so the rotation is unscaled.
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    # With mscale_all_dim apart from mscale the rotated values carry the ratio.
    apart = dataclasses.replace(config, mscale_all_dim=1.0)
    scaled = np.asarray(rope_lib.rope(jnp.asarray(x), jnp.asarray(positions), apart))
    np.testing.assert_allclose(scaled, want * _m(40, 0.5) / _m(40, 1.0), rtol=1e-5, atol=1e-5)


# --- whole-model checks on one device: compiled once per configuration --------------

TINY = {
    "model_name": "tagtrain-tiny",
    "dtype": "float32",
    "base_num_decoder_layers": "2",
    "max_target_length": "16",
}


def _forward(overrides: dict):
    """(params, logits fn) of a tiny model on one device."""
    config = make_config({**TINY, **overrides})
    sizes = validate(config, 1)
    mesh = make_mesh(sizes, config.shard_mode, jax.devices()[:1])
    ctx = ShardCtx(mesh, logical_rules(config.parallelism), config.shard_mode)
    model = model_lib.define(config.model, ctx)
    params, router = model_lib.init(ctx, model, config.seed)
    tokens = jnp.asarray(np.random.default_rng(1).integers(0, 256, (2, 16)), jnp.int32)
    positions = jnp.tile(jnp.arange(16, dtype=jnp.int32), (2, 1))
    segments = jnp.ones_like(tokens)
    jitted = jax.jit(lambda p: model_lib.apply(model, p, router, tokens, positions, segments)[0])

    def logits(p):
        with jax.set_mesh(mesh):
            return np.asarray(jitted(p))

    return config, params, logits


def _interleave_rope_columns(w, rope_dim):
    """The half-split layout's last `rope_dim` columns in interleaved order (pair i of
    the half-split layout, (i, i + R/2), lands on (2i, 2i + 1))."""
    half = rope_dim // 2
    perm = np.stack([np.arange(half), np.arange(half) + half], -1).reshape(-1)
    w = np.asarray(w)
    head, tail = w[..., :-rope_dim], w[..., -rope_dim:]
    return np.concatenate([head, tail[..., perm]], -1)


# V2-Lite's architecture at toy size: YaRN, no q LoRA, softmax greedy routing.
V2_LIKE = {
    "rope_type": "yarn",
    "rope_factor": "40",
    "mscale": "0.707",
    "q_lora_rank": "0",
    "routed_score_func": "softmax",
    "routed_topk_method": "greedy",
    "n_routing_groups": "1",
    "norm_topk_prob": "false",
}


@pytest.fixture(scope="module")
def v2_like_models():
    return _forward(V2_LIKE), _forward({**V2_LIKE, "rope_interleave": "true"})


def test_q_lora_rank_0_is_one_plain_query_projection(v2_like_models):
    (config, params, logits), _ = v2_like_models
    attn = params["dense_layers"]["attn"]
    d, h, k = config.emb_dim, config.base_num_query_heads, config.qk_head_dim
    assert attn["wq_DxHxK"].shape == (1, d, h, k)  # one dense layer, stacked
    assert params["moe_layers"]["attn"]["wq_DxHxK"].shape == (1, d, h, k)
    assert not {"wq_a_DxQ", "wq_b_QxHxK", "q_norm"} & set(attn)
    out = logits(params)
    assert out.shape == (2, 16, config.vocab_size) and np.isfinite(out).all()
    # The MFU count of attention weights follows the plain projection.
    assert flops.count_params(params) == _expected_param_count(config)


def _expected_param_count(c):
    d, h = c.emb_dim, c.base_num_query_heads
    attn = d * h * c.qk_head_dim + d * (c.kv_lora_rank + c.qk_rope_head_dim)
    attn += c.kv_lora_rank * h * (c.qk_nope_head_dim + c.v_head_dim) + h * c.v_head_dim * d
    attn += 2 * d + c.kv_lora_rank  # attn_norm, ffn_norm, kv_norm
    dense = 3 * d * c.base_mlp_dim
    moe = d * c.num_experts + 3 * d * c.base_moe_mlp_dim * (c.num_experts + c.shared_experts)
    layers = c.base_num_decoder_layers * attn + dense + (c.base_num_decoder_layers - 1) * moe
    return layers + 2 * d * c.vocab_size + d


def test_interleaved_rope_on_permuted_weights_equals_the_half_split_model(v2_like_models):
    (config, params, logits), (_, _, interleaved_logits) = v2_like_models
    r = config.qk_rope_head_dim
    permuted = jax.tree.map(lambda x: x, params)
    for stack in ("dense_layers", "moe_layers"):
        attn = permuted[stack]["attn"]
        for name in ("wq_DxHxK", "wkv_a_DxCR"):
            attn[name] = jnp.asarray(_interleave_rope_columns(attn[name], r))
    want = logits(params)
    np.testing.assert_allclose(interleaved_logits(permuted), want, rtol=1e-5, atol=1e-5)
    # The unpermuted weights in the interleaved model are a different model.
    assert np.abs(interleaved_logits(params) - want).max() > 1e-3


@pytest.mark.parametrize(
    "overrides,message",
    [
        ({"q_lora_rank": "-1"}, r"^q_lora_rank=-1 must be >= 0"),
        ({"rope_type": "yarn", "rope_factor": "1"}, r"^rope_factor=1.0 must be > 1"),
        ({"rope_type": "yarn", "beta_slow": "0"}, r"^beta_slow=0.0 must be > 0"),
        ({"rope_type": "yarn", "beta_fast": "0.5"}, r"^beta_fast=0.5 must be >= beta_slow"),
        ({"rope_type": "yarn", "mscale": "-1"}, r"^mscale=-1.0 must be >= 0"),
        (
            {"rope_type": "yarn", "max_position_embeddings": "16"},
            r"^max_target_length=32 exceeds max_position_embeddings=16",
        ),
        (
            {"routed_topk_method": "greedy"},
            r"^routed_topk_method='greedy', n_routing_groups=2 \(moe_kernels' topk_method, "
            r"n_groups\): topk_method='greedy' picks over all experts",
        ),
    ],
)
def test_bad_architecture_options_stop_before_compiling(overrides, message):
    with pytest.raises(ConfigError, match=message):
        validate(make_config(overrides), 8)


def test_unknown_choices_are_refused_at_parse_time():
    with pytest.raises(ConfigError, match=r"^rope_type='ntk' is not one of"):
        make_config({"rope_type": "ntk"})
    with pytest.raises(ConfigError, match=r"^routed_topk_method='top2' is not one of"):
        make_config({"routed_topk_method": "top2"})


# --- presets against the published config.json files (tests/fixtures/hf_configs) ----

FIXTURES = Path(__file__).parent / "fixtures" / "hf_configs"


# Hugging Face key -> trainer key, for the keys the presets carry.
@pytest.mark.parametrize("name", sorted(PRESETS))
def test_every_preset_passes_the_architecture_checks(name):
    config = make_config({"model_name": name})
    check_architecture(config.model, config.data)


@pytest.mark.parametrize(
    "preset,fixture", [("deepseek3-671b", "deepseek_v3"), ("deepseek2-lite", "deepseek_v2_lite")]
)
def test_presets_take_the_published_config_values(preset, fixture):
    published = json.loads((FIXTURES / f"{fixture}.json").read_text())
    config = make_config({"model_name": preset})
    # Every key the importer carries over unchanged (hf_map.DIRECT) is stated by
    # the published file, rope_interleave aside (below), and the preset holds its value.
    stated = [k for k in hf_map.DIRECT if k in published]
    assert set(hf_map.DIRECT) - set(stated) == {"rope_interleave"}
    for hf_key in stated:
        assert getattr(config, hf_map.DIRECT[hf_key]) == published[hf_key], hf_key
    # The converted ones: q_lora_rank null is the plain query projection (0).
    assert config.q_lora_rank == (published["q_lora_rank"] or 0)
    assert config.rope_max_timescale == published["rope_theta"]
    scaling = published["rope_scaling"]
    assert scaling["type"] == config.rope_type == "yarn"
    # YaRN: the importer's keys (truncate: absent from both files) and the two mscales.
    assert set(hf_map.YARN_KEYS) - set(scaling) == {"truncate"}
    for hf_key in set(hf_map.YARN_KEYS) & set(scaling):
        assert getattr(config, hf_map.YARN_KEYS[hf_key]) == scaling[hf_key], hf_key
    assert (config.mscale, config.mscale_all_dim) == (scaling["mscale"], scaling["mscale_all_dim"])
    # Neither file carries rope_interleave: DeepSeek's rope weights are interleaved
    # (V3's default, every V2). Logits are untied from the embedding, as here.
    assert "rope_interleave" not in published and config.rope_interleave
    assert published["tie_word_embeddings"] is False
    assert config.rope_truncate and not config.rope_attention_scaling
