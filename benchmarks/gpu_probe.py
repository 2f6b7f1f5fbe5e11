"""One-off GPU probe (issue #43): what to change, measured on the device in one call.

    PYTHONPATH=$(printf '%s:' $PWD/packages/*/src) python3 benchmarks/gpu_probe.py
    (writes $OUT/probe.json; the 2026-12-04 H200 run is benchmarks/results/gpu_probe.json)

Parts, each in its own process (a JAX process holds the GPU's memory):
  grads   step-1 gradients of the plain and fused schedules, per leaf (6-layer cut)
  ops     microbenchmarks: grouped expert matmul (ragged_dot under XLA flags, dense,
          padded blocks) and attention (XLA vs cuDNN) at deepseek3-small's shapes
  step    train steps of deepseek3-small pdbs 8 GA 4 under variants
  profile a 2-step profile of the base variant: kernel time by category
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time

OUT = os.environ.get("OUT", "/tmp/probe")
SHAPE = {
    "model_name": "deepseek3-small",
    "per_device_batch_size": "8",
    "gradient_accumulation_steps": "4",
    "enable_tensorboard": "false",
}


def timed(fn, *args, n=10):
    import jax

    jax.block_until_ready(fn(*args))
    ts = []
    for _ in range(n):
        t = time.perf_counter()
        jax.block_until_ready(fn(*args))
        ts.append(time.perf_counter() - t)
    return 1e3 * statistics.median(ts)


# ---------------------------------------------------------------- grads
def part_grads(arg):
    import jax
    import jax.numpy as jnp
    import numpy as np

    import accum
    from trainer.config import make_config
    from trainer.run import run as run_lib
    from trainer.step import train_step

    cfg = make_config(
        {
            **SHAPE,
            "per_device_batch_size": "2",
            "base_num_decoder_layers": arg or "6",
        }
    )
    run = run_lib.setup(cfg, jax.devices())
    batch = run_lib.batch_for(run, 0)
    loss_fn = train_step.make_loss_fn(cfg.model, run.model, run.state["router"], None)
    out = {}
    grads = {}
    for schedule in ("plain", "fused"):

        def g(params, batch, schedule=schedule):
            return accum.accumulate_gradients(
                loss_fn,
                params,
                batch,
                num_microbatches=4,
                plan=run.plan,
                schedule=schedule,
                accum_dtype=jnp.float32,
            )

        with jax.set_mesh(run.ctx.mesh):
            loss, _, gr = jax.jit(g)(run.state["params"], batch)
        grads[schedule] = jax.tree.map(lambda x: np.asarray(x, np.float32), gr)
        out[f"loss_{schedule}"] = float(loss)
    rows = []
    flat_p = jax.tree_util.tree_flatten_with_path(grads["plain"])[0]
    flat_f = jax.tree.leaves(grads["fused"])
    for (path, a), b in zip(flat_p, flat_f, strict=True):
        den = float(np.linalg.norm(a)) or 1.0
        rows.append((jax.tree_util.keystr(path), float(np.linalg.norm(a - b)) / den, den))
    rows.sort(key=lambda r: -r[1])
    out["worst_leaves"] = rows[:12]
    out["leaves_over_1e-2"] = sum(r[1] > 1e-2 for r in rows)
    out["leaves"] = len(rows)
    return out


# ---------------------------------------------------------------- ops
def block_swiglu(rows_AxD, w0, w1, wo, sizes_E, bm):
    """Grouped SwiGLU over expert-sorted rows by padded blocks of bm rows."""
    import jax
    import jax.numpy as jnp

    a, d = rows_AxD.shape
    e = sizes_E.shape[0]
    nb = -(-a // bm) + e
    padded = (sizes_E + bm - 1) // bm * bm
    ends = jnp.cumsum(sizes_E)
    pends = jnp.cumsum(padded)
    i = jnp.arange(a)
    row_e = jnp.searchsorted(ends, i, side="right")
    valid = row_e < e
    row_e_c = jnp.minimum(row_e, e - 1)
    dest = jnp.where(
        valid, pends[row_e_c] - padded[row_e_c] + i - (ends[row_e_c] - sizes_E[row_e_c]), nb * bm
    )
    xp = jnp.zeros((nb * bm, d), rows_AxD.dtype).at[dest].set(rows_AxD, mode="drop")
    block_e = jnp.minimum(jnp.searchsorted(pends, jnp.arange(nb) * bm, side="right"), e - 1)
    xb = xp.reshape(nb, bm, d)
    h0 = jnp.einsum("nbd,ndf->nbf", xb, w0[block_e])
    h1 = jnp.einsum("nbd,ndf->nbf", xb, w1[block_e])
    y = jnp.einsum("nbf,nfd->nbd", jax.nn.silu(h0) * h1, wo[block_e])
    return y.reshape(nb * bm, d).at[dest].get(mode="fill", fill_value=0)


def part_ops(arg):
    import jax
    import jax.numpy as jnp
    import numpy as np

    res = {"xla_flags": os.environ.get("XLA_FLAGS", "")}
    key = jax.random.PRNGKey(0)
    t, k, e, d, f = 8192, 2, 16, 1024, 512
    a = t * k
    ks = jax.random.split(key, 6)
    x = jax.random.normal(ks[0], (a, d), jnp.bfloat16)
    w0 = (jax.random.normal(ks[1], (e, d, f)) / 32).astype(jnp.bfloat16)
    w1 = (jax.random.normal(ks[2], (e, d, f)) / 32).astype(jnp.bfloat16)
    wo = (jax.random.normal(ks[3], (e, f, d)) / 22).astype(jnp.bfloat16)
    ids = jnp.sort(jax.random.randint(ks[4], (a,), 0, e))
    sizes = jnp.bincount(ids, length=e).astype(jnp.int32)

    def ragged(x, w0, w1, wo, sizes):
        h0 = jax.lax.ragged_dot(x, w0, sizes)
        h1 = jax.lax.ragged_dot(x, w1, sizes)
        return jax.lax.ragged_dot(jax.nn.silu(h0) * h1, wo, sizes)

    def loss_of(fn):
        def lossf(x, w0, w1, wo, sizes):
            return jnp.sum(fn(x, w0, w1, wo, sizes).astype(jnp.float32) ** 2)

        return jax.jit(jax.value_and_grad(lossf, argnums=(0, 1, 2, 3)))

    ref = None
    impls = {"ragged_dot": ragged}
    if not res["xla_flags"]:
        for bm in (128, 256, 512):
            impls[f"blocks_{bm}"] = lambda x, w0, w1, wo, s, bm=bm: block_swiglu(
                x, w0, w1, wo, s, bm
            )
    for name, fn in impls.items():
        try:
            vg = loss_of(fn)
            ms = timed(vg, x, w0, w1, wo, sizes)
            val, grads = vg(x, w0, w1, wo, sizes)
            g = np.asarray(grads[1], np.float32)
            if ref is None:
                ref = g
            rel = float(np.linalg.norm(g - ref) / np.linalg.norm(ref))
            res[name] = {"fwd_bwd_ms": ms, "rel_dw0_vs_first": rel}
        except Exception as err:  # noqa: BLE001
            res[name] = {"error": str(err)[:300]}
    # 2 x active flops fwd, x3 fwd+bwd
    res["active_tflop"] = 3 * 3 * 2 * a * d * f / 1e12
    if res["xla_flags"]:
        return res
    # attention: B=8 S=1024 H=16, qk 96, v 64
    b, s, h = 8, 1024, 16
    q = jax.random.normal(ks[0], (b, s, h, 96), jnp.bfloat16)
    kk = jax.random.normal(ks[1], (b, s, h, 96), jnp.bfloat16)
    v = jax.random.normal(ks[2], (b, s, h, 64), jnp.bfloat16)

    def xla_attn(q, kk, v):
        lg = jnp.einsum("bshk,bthk->bhst", q, kk).astype(jnp.float32) / np.sqrt(96)
        mask = jnp.tril(jnp.ones((s, s), bool))
        lg = jnp.where(mask, lg, -1e30)
        p = jax.nn.softmax(lg, -1).astype(q.dtype)
        return jnp.einsum("bhst,bthv->bshv", p, v)

    def dpa(impl, pad):
        def fn(q, kk, v):
            vv = jnp.pad(v, ((0, 0), (0, 0), (0, 0), (0, 32))) if pad else v
            o = jax.nn.dot_product_attention(
                q, kk, vv, is_causal=True, scale=1 / np.sqrt(96), implementation=impl
            )
            return o[..., :64]

        return fn

    attns = {
        "attn_xla_handwritten": xla_attn,
        "attn_dpa_xla": dpa("xla", False),
        "attn_dpa_cudnn_v64": dpa("cudnn", False),
        "attn_dpa_cudnn_pad96": dpa("cudnn", True),
    }
    aref = None
    for name, fn in attns.items():
        try:

            def lossf(q, kk, v, fn=fn):
                return jnp.sum(fn(q, kk, v).astype(jnp.float32) ** 2)

            vg = jax.jit(jax.value_and_grad(lossf, argnums=(0, 1, 2)))
            ms = timed(vg, q, kk, v)
            _, gr = vg(q, kk, v)
            gq = np.asarray(gr[0], np.float32)
            if aref is None:
                aref = gq
            res[name] = {
                "fwd_bwd_ms": ms,
                "rel_dq": float(np.linalg.norm(gq - aref) / np.linalg.norm(aref)),
            }
        except Exception as err:  # noqa: BLE001
            res[name] = {"error": str(err)[:300]}
    return res


# ---------------------------------------------------------------- steps
def part_step(arg):
    import jax

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import benchlib as bl
    import gpu_profile

    from trainer.model import flops

    overrides = dict(SHAPE)
    overrides.update(json.loads(arg or "{}"))
    res = {"overrides": overrides, "xla_flags": os.environ.get("XLA_FLAGS", "")}
    try:
        step = bl.TrainerStep(overrides)
        times = []
        for _ in range(4):
            t = time.perf_counter()
            _, m = jax.block_until_ready(step.step())
            times.append(time.perf_counter() - t)
    except Exception as err:  # noqa: BLE001
        return {**res, "error": str(err)[:300]}
    cfg = step.config
    sec = statistics.median(times[1:])
    tps = step.run.batch_size * cfg.max_target_length / sec
    peak = flops.peak_tflops(cfg.output, jax.devices()[0].device_kind)
    res.update(
        step_ms=1e3 * sec,
        mfu=flops.training_flops_per_token(cfg.model, cfg.data) * tps / (peak * 1e12)
        if peak
        else None,
        loss=float(m["loss"]),
        compile_s=step.compile_s,
        peak_gib=(jax.devices()[0].memory_stats() or {}).get("peak_bytes_in_use", 0) / 2**30,
    )
    if os.environ.get("PROBE_PROFILE"):
        d = os.path.join("/tmp", "probe_trace")
        jax.profiler.start_trace(d)
        for _ in range(2):
            jax.block_until_ready(step.step())
        jax.profiler.stop_trace()
        try:
            res["profile"] = gpu_profile.read(d, 2)
        except Exception as err:  # noqa: BLE001
            res["profile"] = {"error": str(err)[:300]}
    return res


PARTS = {"grads": part_grads, "ops": part_ops, "step": part_step}


def spawn(part, arg="", env=None, timeout=240):
    cmd = [sys.executable, os.path.abspath(__file__), part, arg]
    t = time.time()
    try:
        p = subprocess.run(
            cmd, env={**os.environ, **(env or {})}, capture_output=True, text=True, timeout=timeout
        )
    except subprocess.TimeoutExpired:
        return {"error": "timeout"}
    lines = [x for x in p.stdout.splitlines() if x.startswith("RESULT ")]
    if not lines:
        return {"error": (p.stderr.strip().splitlines() or ["?"])[-1][:300]}
    r = json.loads(lines[-1][7:])
    r["wall_s"] = time.time() - t
    return r


def main():
    if len(sys.argv) > 1 and sys.argv[1] in PARTS:
        print("RESULT " + json.dumps(PARTS[sys.argv[1]](sys.argv[2] if len(sys.argv) > 2 else "")))
        return
    os.makedirs(OUT, exist_ok=True)
    results = {}
    start = time.time()
    plan = [
        ("ops", "ops", "", {}),
        ("grads", "grads", "6", {}),
        ("step_base_profile", "step", "{}", {"PROBE_PROFILE": "1"}),
        (
            "ops_grouped_gemm",
            "ops",
            "",
            {"XLA_FLAGS": "--xla_gpu_experimental_use_ragged_dot_grouped_gemm=true"},
        ),
        (
            "ops_ragged_fusion",
            "ops",
            "",
            {"XLA_FLAGS": "--xla_gpu_experimental_use_ragged_dot_fusion=true"},
        ),
        ("step_dense", "step", '{"sparse_matmul": "false"}', {}),
        ("step_remat_full", "step", '{"remat_policy": "full"}', {}),
        (
            "step_grouped_gemm",
            "step",
            "{}",
            {"XLA_FLAGS": "--xla_gpu_experimental_use_ragged_dot_grouped_gemm=true"},
        ),
    ]
    budget = float(os.environ.get("PROBE_BUDGET_S", "270"))
    for name, part, arg, env in plan:
        if time.time() - start > budget:
            results[name] = {"error": "skipped: budget"}
            continue
        results[name] = spawn(part, arg, env)
        print(name, json.dumps(results[name])[:1500], flush=True)
        with open(os.path.join(OUT, "probe.json"), "w") as fh:
            json.dump(results, fh, indent=1)
    print("total s", time.time() - start)


if __name__ == "__main__":
    main()
