"""A plain-JAX dense transformer, written the simplest idiomatic way, as a speed reference.

Same width, heads, sequence and active FLOPs per token as the trainer's model: the MLP
hidden size is chosen so that 6 x matmul params + attention matches
trainer.model.flops.training_flops_per_token of the MoE model it stands beside. No sharding,
no scan, no tags: a Python loop over layers under one jit, bf16 compute on f32
parameters, jax.nn.dot_product_attention (cuDNN where it runs), optax AdamW, one
value_and_grad over the whole batch. device_check.py times it in the same run as the
trainer and puts tagtrain's MFU over this one's on its page.
"""

from __future__ import annotations

import math
import time

import jax
import jax.numpy as jnp
import optax


def shape_for(model, data) -> dict:
    """The reference's dims for a trainer ModelConfig/DataConfig: equal FLOPs per token."""
    from trainer.model import flops

    d, h, v = model.emb_dim, model.base_num_query_heads, model.vocab_size
    layers = model.base_num_decoder_layers
    head = d // h
    target = flops.training_flops_per_token(model, data)
    attention = 6.0 * layers * data.max_target_length * h * 2 * head
    per_layer_ffn = (target - attention) / 6.0 - d * v - layers * 4 * d * d
    mlp = max(128, int(per_layer_ffn / (3 * d * layers)) // 128 * 128)
    return {"d": d, "heads": h, "head": head, "mlp": mlp, "layers": layers, "vocab": v}


def flops_per_token(shape: dict, seq: int) -> float:
    d, layers = shape["d"], shape["layers"]
    params = layers * (4 * d * d + 3 * d * shape["mlp"]) + d * shape["vocab"]
    return 6.0 * params + 6.0 * layers * seq * shape["heads"] * 2 * shape["head"]


def init(shape: dict, key) -> dict:
    d, f, v = shape["d"], shape["mlp"], shape["vocab"]

    def normal(key, *dims):
        return jax.random.normal(key, dims, jnp.float32) / math.sqrt(dims[0])

    layers = []
    for layer_key in jax.random.split(key, shape["layers"]):
        k = jax.random.split(layer_key, 7)
        layers.append(
            {
                "wq": normal(k[0], d, d),
                "wk": normal(k[1], d, d),
                "wv": normal(k[2], d, d),
                "wo": normal(k[3], d, d),
                "w1": normal(k[4], d, f),
                "w3": normal(k[5], d, f),
                "w2": normal(k[6], f, d),
                "n1": jnp.ones((d,)),
                "n2": jnp.ones((d,)),
            }
        )
    k1, k2 = jax.random.split(jax.random.fold_in(key, 1))
    return {
        "embed": normal(k1, v, d) * math.sqrt(v),
        "layers": layers,
        "norm": jnp.ones((d,)),
        "head": normal(k2, d, v),
    }


def rms_norm(x, scale):
    x32 = x.astype(jnp.float32)
    y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, -1, keepdims=True) + 1e-6)
    return (y * scale).astype(x.dtype)


def causal_attention(q, k, v, implementation):
    """jax's causal attention (cuDNN's fused kernel where it runs). A function of its
    own so that bench_gpu_estimate.py, pricing this program compiled for a GPU on a
    CPU host (XLA's attention there), can name its kernels as cuDNN's."""
    return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation=implementation)


def forward(params, tokens, shape, implementation):
    bf = jnp.bfloat16
    b, s = tokens.shape
    h, hd = shape["heads"], shape["head"]
    x = params["embed"][tokens].astype(bf)
    for p in params["layers"]:
        p = jax.tree.map(lambda w: w.astype(bf), p)
        y = rms_norm(x, p["n1"])
        q, k, v = ((y @ p[n]).reshape(b, s, h, hd) for n in ("wq", "wk", "wv"))
        a = causal_attention(q, k, v, implementation)
        x = x + a.reshape(b, s, h * hd) @ p["wo"]
        y = rms_norm(x, p["n2"])
        x = x + (jax.nn.silu(y @ p["w1"]) * (y @ p["w3"])) @ p["w2"]
    x = rms_norm(x, params["norm"].astype(bf))
    return (x @ params["head"].astype(bf)).astype(jnp.float32)


def make_step(shape, implementation):
    tx = optax.adamw(1e-4)

    def loss_fn(params, tokens):
        logits = forward(params, tokens[:, :-1], shape, implementation)
        return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()

    @jax.jit
    def step(params, opt_state, tokens):
        loss, grads = jax.value_and_grad(loss_fn)(params, tokens)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return tx, step


def lower(shape: dict, batch: int, seq: int, implementation, device):
    """The step lowered for `device` on abstract arguments (nothing allocated): what a
    compile for a GPU target from a CPU host takes (bench_gpu_estimate.py)."""
    sharding = jax.sharding.SingleDeviceSharding(device)

    def abstract(tree):
        return jax.tree.map(
            lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding), tree
        )

    tx, step = make_step(shape, implementation)
    params = jax.eval_shape(lambda: init(shape, jax.random.key(0)))
    tokens = jax.ShapeDtypeStruct((batch, seq + 1), jnp.int32, sharding=sharding)
    return step.lower(abstract(params), abstract(jax.eval_shape(tx.init, params)), tokens)


def measure(model, data, batch: int, steps: int) -> dict:
    """Median step time of the reference on `batch` sequences of data.max_target_length + 1."""
    shape = shape_for(model, data)
    on_gpu = jax.default_backend() == "gpu"
    implementation = "cudnn" if on_gpu else None
    params = init(shape, jax.random.key(0))
    tx, step = make_step(shape, implementation)
    opt_state = tx.init(params)
    seq = data.max_target_length
    tokens = jax.random.randint(jax.random.key(1), (batch, seq + 1), 0, shape["vocab"])
    times, losses = [], []
    for _ in range(steps):
        start = time.perf_counter()
        params, opt_state, loss = jax.block_until_ready(step(params, opt_state, tokens))
        times.append(time.perf_counter() - start)
        losses.append(float(loss))
    seconds = sorted(times[1:] or times)[len(times[1:] or times) // 2]
    return {
        "shape": shape,
        "attention": implementation or "xla",
        "step_ms": 1e3 * seconds,
        "tokens_per_s": batch * seq / seconds,
        "flops_per_token": flops_per_token(shape, seq),
        "losses": losses,
    }
