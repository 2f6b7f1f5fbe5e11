"""A small model for the accum tests and benchmark: embedding lookup, a scan over
layers (RMS norm with a scale, biased MLP, a soft mixture of experts), and a
cross-entropy head with a padding mask. Written for both shard modes; weights
are gathered to their compute layout with `carry_reduced_axes`, which keeps
the `reduced` tag (the `drop=` option rebuilds one spec without it, on purpose).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import accum
import pspec_tags as pt

VOCAB, DIM, HIDDEN, EXPERTS, EXPERT_HIDDEN, LAYERS, SEQ = 32, 16, 32, 4, 8, 3, 4

LOGICAL = {
    "embed": ("vocab", "embed"),
    "head": ("embed", "vocab"),
    "layers": {
        "scale": ("layers", "embed"),
        "w1": ("layers", "embed", "mlp"),
        "b1": ("layers", "mlp"),
        "w2": ("layers", "mlp", "embed"),
        "b2": ("layers", "embed"),
        "router": ("layers", "embed", None),
        "we": ("layers", "exp", "embed", None),
        "wo": ("layers", "exp", None, "embed"),
    },
}

# name -> (mesh shape, rules). Weights keep `embed` sharded over fsdp at rest and
# are gathered before use; tensor/expert partitions stay in the compute layout.
MESHES = {
    "data8": ({"data": 8}, {"activation_batch": ("data",)}),
    "data4_fsdp2": (
        {"data": 4, "fsdp": 2},
        {"activation_batch": ("data", "fsdp"), "embed": "fsdp"},
    ),
    "data2_expert4": ({"data": 2, "expert": 4}, {"activation_batch": ("data",), "exp": "expert"}),
    "data2_tensor2_fsdp2": (
        {"data": 2, "tensor": 2, "fsdp": 2},
        {"activation_batch": ("data", "fsdp"), "embed": "fsdp", "mlp": "tensor"},
    ),
}
_NONE_RULES = ("vocab", "embed", "layers", "mlp", "exp")


def rules_for(name):
    rules = dict.fromkeys(_NONE_RULES)
    rules.update(MESHES[name][1])
    return rules


def make_mesh(name, mode="explicit", devices=None):
    shape = MESHES[name][0]
    kind = AxisType.Explicit if mode == "explicit" else AxisType.Auto
    if devices is None:
        return jax.make_mesh(tuple(shape.values()), tuple(shape), axis_types=(kind,) * len(shape))
    grid = np.array(devices).reshape(tuple(shape.values()))
    return jax.sharding.Mesh(grid, tuple(shape), axis_types=(kind,) * len(shape))


def param_specs(mesh, rules):
    return jax.tree.map(
        lambda axes: pt.logical_to_spec(axes, rules, mesh),
        LOGICAL,
        is_leaf=lambda x: isinstance(x, tuple),
    )


def init_params(seed, dtype=np.float32):
    """Host-side (numpy) init: no JAX dispatch, so no per-op compiles in the tests."""
    rng = np.random.default_rng(seed)
    shapes = {
        "embed": (VOCAB, DIM),
        "head": (DIM, VOCAB),
        "layers": {
            "scale": (LAYERS, DIM),
            "w1": (LAYERS, DIM, HIDDEN),
            "b1": (LAYERS, HIDDEN),
            "w2": (LAYERS, HIDDEN, DIM),
            "b2": (LAYERS, DIM),
            "router": (LAYERS, DIM, EXPERTS),
            "we": (LAYERS, EXPERTS, DIM, EXPERT_HIDDEN),
            "wo": (LAYERS, EXPERTS, EXPERT_HIDDEN, DIM),
        },
    }

    def one(shape):
        fan_in = shape[-2] if len(shape) > 2 else shape[-1]
        return (0.3 * rng.standard_normal(shape) / np.sqrt(fan_in)).astype(dtype)

    params = jax.tree.map(one, shapes, is_leaf=lambda x: isinstance(x, tuple))
    params["layers"]["scale"] = (1.0 + 0.1 * rng.standard_normal((LAYERS, DIM))).astype(dtype)
    return params


def make_batch(seed, batch_size, pad_fraction=0.25):
    """Host-side token ids, targets and a padding mask (1 = counted target)."""
    rng = np.random.default_rng(seed)
    return {
        "ids": rng.integers(0, VOCAB, (batch_size, SEQ), dtype=np.int32),
        "targets": rng.integers(0, VOCAB, (batch_size, SEQ), dtype=np.int32),
        "mask": (rng.uniform(size=(batch_size, SEQ)) >= pad_fraction).astype(np.float32),
    }


def place(tree, specs, mesh):
    return jax.tree.map(lambda x, s: jax.device_put(x, NamedSharding(mesh, s)), tree, specs)


def batch_specs(mesh, rules):
    (lead,) = pt.logical_to_spec(("activation_batch",), rules, mesh).partitions
    return {"ids": P(lead, None), "targets": P(lead, None), "mask": P(lead, None)}


def lookup(table, ids, mode):
    """Rows `table[ids]` whose gradient stays unreduced: a local gather in a shard_map.

    `.at[].get(out_sharding=...)` passes the accum guard too (its transpose
    reduces nothing), but JAX 0.10's gather rule all-gathers the ids and the
    activation cotangents to do it. A shard_map whose in_spec keeps the table's
    `reduced` tag transposes to an unreduced scatter-add with no collective.
    Needs an unsharded vocab dim.
    """
    if mode != "explicit":
        return jnp.take(table, ids, axis=0)
    table_spec, ids_spec = pt.spec_of(table), pt.spec_of(ids)
    out = P(*pt.partitions(ids_spec), *pt.partitions(table_spec)[1:2])
    reduced = tuple(sorted(pt.reduced_axes(table_spec)))

    def local(t, i):
        # Free cast reduced -> varying (its transpose is varying -> unreduced):
        # the automatic pvary for the ids' other axes refuses reduced inputs.
        if reduced:
            t = jax.lax.pcast(t, reduced, to="varying")
        return jnp.take(t, i, axis=0)

    return jax.shard_map(
        local,
        mesh=jax.typeof(table).sharding.mesh,
        in_specs=(table_spec, ids_spec),
        out_specs=out,
    )(table, ids)


class Model:
    """loss_fn factory. `compute` maps each parameter to its compute spec (at-rest spec
    with the fsdp axis removed); `drop` names one layer parameter gathered without its tag."""

    def __init__(self, mesh, rules, mode="explicit", drop=None):
        self.mode, self.drop = mode, drop
        self.batch = pt.logical_to_spec(("activation_batch",), rules, mesh).partitions[0]
        gather_rules = {k: (None if k == "embed" else v) for k, v in rules.items()}
        self.compute = param_specs(mesh, gather_rules)

    def _gather(self, w, spec, name=None):
        if self.mode != "explicit":
            return pt.shard(w, spec, "auto")
        # A spec rebuilt from logical rules carries no tag: copy the value's
        # reduced axes back, or the gradient all-reduce moves into the loop.
        if name is not None and name == self.drop:
            return jax.reshard(w, spec)
        target = pt.carry_reduced_axes(spec, w)
        if pt.reduced_axes(target):
            # FSDP gather under deferral: the gathered axes become reduced too.
            # Its transpose is then a reduce-scatter of an unreduced cotangent
            # (over fsdp only), and the matmul's weight gradient may stay
            # unreduced over every batch axis; JAX rejects a dot whose
            # unreduced axes are a strict subset of its contracting axes.
            gathered = set(pt.mesh_axes_used(pt.spec_of(w))) - set(pt.mesh_axes_used(spec))
            target = pt.with_reduced(target, gathered)
        return jax.reshard(w, target)

    def _dot(self, eq, a, b, out):
        if self.mode == "explicit":
            return jnp.einsum(eq, a, b, out_sharding=out)
        return pt.shard(jnp.einsum(eq, a, b), out, "auto")

    def loss_fn(self, params, mb):
        act = P(self.batch, None, None)
        table = self._gather(params["embed"], self.compute["embed"], "embed")
        x = lookup(table, mb["ids"], self.mode)
        layer_specs = {
            k: pt.truncate(P(*v.partitions[1:]), 9) for k, v in self.compute["layers"].items()
        }

        def layer(x, lp):
            w = {k: self._gather(v, layer_specs[k], k) for k, v in lp.items()}
            h = x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + 1e-6)
            h = h * pt.broadcast_param(w["scale"], h)
            mlp = P(self.batch, None, layer_specs["w1"].partitions[1])
            u = self._dot("btd,df->btf", h, w["w1"], mlp)
            u = jax.nn.gelu(u + pt.broadcast_param(w["b1"], u))
            y = self._dot("btf,fd->btd", u, w["w2"], act)
            y = y + pt.broadcast_param(w["b2"], y)
            gate = jax.nn.softmax(self._dot("btd,de->bte", h, w["router"], act), axis=-1)
            exp = layer_specs["we"].partitions[0]
            e = self._dot("btd,edf->btef", h, w["we"], P(self.batch, None, exp, None))
            e = jax.nn.relu(e)
            e = self._dot("btef,efd->bted", e, w["wo"], P(self.batch, None, exp, None))
            if self.mode == "explicit":
                moe = jnp.einsum("bted,bte->btd", e, gate, out_sharding=act)
            else:
                moe = jnp.einsum("bted,bte->btd", e, gate)
            return x + y + moe, None

        # accum.scan_layers: lax.scan, fused with accumulation when asked (test_fused.py).
        x, _ = accum.scan_layers(layer, x, params["layers"])
        head = self._gather(params["head"], self.compute["head"], "head")
        logits = self._dot("btd,dv->btv", x, head, act)
        logp = jax.nn.log_softmax(logits, axis=-1)
        onehot = jax.nn.one_hot(mb["targets"], VOCAB, dtype=logp.dtype)
        xent = -jnp.sum(onehot * logp, axis=-1)
        mask = mb["mask"]
        correct = (jnp.argmax(logits, axis=-1) == mb["targets"]).astype(jnp.float32) * mask
        return jnp.sum(xent * mask), {"weight": jnp.sum(mask), "correct": jnp.sum(correct)}

    def full_batch_loss(self, params, batch):
        loss_sum, aux = self.loss_fn(params, batch)
        return loss_sum / aux["weight"], aux
