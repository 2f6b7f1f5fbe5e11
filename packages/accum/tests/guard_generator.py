"""Seeded random models for the compiled verdict, and an oracle of their own.

`program(seed)` draws a small model: an embedding lookup, a few body layers
and a loss, each from the idioms a JAX user writes under explicit sharding
(some keep every tag, some drop one, some reduce a batch axis on purpose),
on replicated, tensor-, FSDP- (a 'data' x 'fsdp' mesh: weights at rest over
'fsdp', gathered per use) or data-sharded weights, plus how it is accumulated
(plain, fused, ZeRO-1, start/add/finish, hierarchical). `oracle_reduces(text,
...)` counts the all-reduces and reduce-scatters of more than 8 elements that
the backward pass makes (a forward psum is the model's own communication) over
the watched axis inside the microbatch loop, judged per parameter: the
gradient of a weight sharded over that axis at rest is reduced over it per use
by design (its use is named `per_use[<name>]`, read back from each reduced
array's op_name), every other one defers it. It reads the HLO text directly
(regular expressions over while loops, their trip counts, called computations
and replica groups), not through hlo_tools or accum.verdict.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import re
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import accum
import pspec_tags as pt

ROWS, SEQ, DIM, VOCAB, LAYERS, MICROBATCHES = 16, 2, 16, 16, 3, 2
MAX_ELEMENTS = 8

# mesh name -> (axis sizes, batch axes, watched axis, policy, slice axes)
MESHES = {
    "data8": ({"data": 8}, ("data",), "data", None, ()),
    "data4_tensor2": ({"data": 4, "tensor": 2}, ("data",), "data", None, ()),
    # FSDP: tokens over both axes, weights at rest over 'fsdp' (gathered per use,
    # reduce-scattered over 'fsdp' in every backward pass by design), 'data' deferred.
    "data2_fsdp4": ({"data": 2, "fsdp": 4}, ("data", "fsdp"), "data", None, ()),
    "hierarchical": ({"dcn": 2, "data": 4}, ("dcn", "data"), "dcn", "hierarchical", ("dcn",)),
}
MESH_ODDS = (0.4, 0.25, 0.2, 0.15)
VARIANTS = ("plain", "fused", "zero1", "add")
# ZeRO-1 shards the masters over 'data' and refuses a mesh that also does FSDP.
FSDP_VARIANTS = ("plain", "fused", "add")


@dataclasses.dataclass
class Program:
    """One drawn model: its parts, mesh and accumulation variant."""

    seed: int
    mesh_name: str
    variant: str
    embed: str
    body: list[str]
    loss: str
    penalty: bool

    def describe(self) -> str:
        return (
            f"seed={self.seed} mesh={self.mesh_name} variant={self.variant} embed={self.embed} "
            f"body={self.body} loss={self.loss} penalty={self.penalty}"
        )


EMBEDS = ("at_get", "one_hot", "take_local", "at_get_untagged")
BODY = (
    "dense_tanh",
    "dense_gelu",
    "dense_relu",
    "dense_dropped",
    "dense_tensor",
    "dense_fsdp",
    "dense_fsdp_dropped",
    "stack_fsdp",
    "dense_data_sharded",
    "norm",
    "norm_dropped",
    "residual",
    "stack",
    "stack_remat",
    "stack_dropped",
    "stack_norm",
    "reshard_activations",
    "shard_map_carried",
    "shard_map_psum_param",
    "shard_map_psum_activations",
    "batch_contraction",
    "take_along",
    "at_add",
)
LOSSES = ("optax_int_ce", "optax_onehot_ce", "log_softmax_take", "masked_mean", "mse")


# Body ops that only make sense on some meshes.
_ONLY_ON = {
    "dense_tensor": ("data4_tensor2",),
    "dense_fsdp": ("data2_fsdp4",),
    "dense_fsdp_dropped": ("data2_fsdp4",),
    "stack_fsdp": ("data2_fsdp4",),
    # A weight sharded over the only batch axis (ZeRO-3 over 'data'): that axis
    # is then reduced per use for it, so no axis is deferred strictly (rarely drawn).
    "dense_data_sharded": ("data8",),
}


def program(seed: int) -> Program:
    """The model drawn from `seed` (numpy's default_rng: the same on every host)."""
    rng = np.random.default_rng(seed)
    mesh_name = str(rng.choice(list(MESHES), p=MESH_ODDS))
    variants = FSDP_VARIANTS if mesh_name == "data2_fsdp4" else VARIANTS
    variant = "hierarchical" if mesh_name == "hierarchical" else str(rng.choice(variants))
    body_choices = [b for b in BODY if mesh_name in _ONLY_ON.get(b, (mesh_name,))]
    body = [str(b) for b in rng.choice(body_choices, size=int(rng.integers(1, 4)))]
    return Program(
        seed=seed,
        mesh_name=mesh_name,
        variant=variant,
        embed=str(rng.choice(EMBEDS)),
        body=body,
        loss=str(rng.choice(LOSSES)),
        penalty=bool(rng.random() < 0.3),
    )


# ---------------------------------------------------------------- the model


def per_use_scope(name: str) -> str:
    """The name scope around a use of parameter `name` gathered from its at-rest
    shards: the oracle reads it back from the HLO's op_names."""
    return f"per_use[{name}]"


class Model:
    """The loss_fn of a Program, and its parameters and batch."""

    def __init__(self, prog: Program):
        self.prog = prog
        sizes, self.batch_axes, self.watched, self.policy, self.slice_axes = MESHES[prog.mesh_name]
        self.mesh = jax.make_mesh(
            tuple(sizes.values()), tuple(sizes), axis_types=(AxisType.Explicit,) * len(sizes)
        )
        batch = self.batch_axes if len(self.batch_axes) > 1 else self.batch_axes[0]
        self.act = P(batch, None, None)  # TAG: batch-sharded activations
        self.rows = P(batch, None)  # TAG: batch-sharded ids
        self.fsdp = "fsdp" in sizes
        # Weights at rest over a batch axis: the plan reduces that axis per use for
        # them and defers the others (per_parameter_axes), as the trainer's FSDP does.
        self.per_parameter = self.fsdp or "dense_data_sharded" in prog.body

    # -- parameters and batch

    def params(self) -> dict:
        rng = np.random.default_rng(self.prog.seed + 1)

        def put(shape, spec=None):
            spec = P() if spec is None else spec
            value = (0.3 * rng.standard_normal(shape)).astype(np.float32)
            return jax.device_put(value, NamedSharding(self.mesh, spec))

        # TAG: FSDP keeps the output head over 'fsdp' at rest, gathered in the loss.
        head = P("fsdp", None) if self.fsdp else P()
        params = {"embed": put((VOCAB, DIM)), "head": put((DIM, VOCAB), head)}
        for i, op in enumerate(self.prog.body):
            if op == "dense_tensor":
                # TAG: weights sharded over a model axis, not a batch axis
                params[f"w{i}"] = put((DIM, DIM), P(None, "tensor"))
                params[f"v{i}"] = put((DIM, DIM), P("tensor", None))
            elif op in ("dense_fsdp", "dense_fsdp_dropped"):
                params[f"w{i}"] = put((DIM, DIM), P("fsdp", None))  # TAG: FSDP at rest
            elif op == "stack_fsdp":
                # TAG: each layer FSDP-sharded at rest; the layer axis unsharded (fusable)
                params[f"w{i}"] = put((LAYERS, DIM, DIM), P(None, "fsdp", None))
            elif op == "dense_data_sharded":
                params[f"w{i}"] = put((DIM, DIM), P("data", None))  # TAG: ZeRO-3 over data
            elif op == "stack_norm":
                params[f"w{i}"] = put((LAYERS, DIM))
            elif op.startswith("stack"):
                params[f"w{i}"] = put((LAYERS, DIM, DIM))
            elif op.startswith("norm"):
                params[f"w{i}"] = put((DIM,))
            elif op not in ("reshard_activations", "take_along", "at_add"):
                params[f"w{i}"] = put((DIM, DIM))
        return params

    def batch(self) -> dict:
        rng = np.random.default_rng(self.prog.seed + 2)
        ids = rng.integers(0, VOCAB, (ROWS, SEQ), dtype=np.int32)
        labels = rng.integers(0, VOCAB, (ROWS, SEQ), dtype=np.int32)
        sharding = NamedSharding(self.mesh, self.rows)
        return {"ids": jax.device_put(ids, sharding), "labels": jax.device_put(labels, sharding)}

    # -- pieces

    def _dot(self, eq, a, b, out=None):
        return jnp.einsum(eq, a, b, out_sharding=self.act if out is None else out)

    def _embed(self, p, ids):
        table = p["embed"]
        kind = self.prog.embed
        if kind == "at_get":
            return table.at[ids].get(out_sharding=self.act)
        if kind == "at_get_untagged":
            # A spec rebuilt from rules: the tag is gone before the lookup.
            return jax.reshard(table, P(None, None)).at[ids].get(out_sharding=self.act)
        if kind == "one_hot":
            onehot = jax.nn.one_hot(ids, VOCAB, dtype=jnp.float32)
            return self._dot("btv,vd->btd", onehot, table)

        def local(t, i):
            return jnp.take(pt.to_varying(t, self.batch_axes), i, axis=0)

        return jax.shard_map(local, in_specs=(pt.spec_of(table), self.rows), out_specs=self.act)(
            table, ids
        )

    def _gather(self, w):
        """A weight at rest over batch axes, gathered whole for one use (FSDP's forward)."""
        target = P(None, None)
        tag = accum.reduced_at_use(pt.spec_of(w), target, self.batch_axes)
        # TAG: the plan's per-use rule: reduced over the gathered token axes too, so
        # the transpose is a reduce-scatter over them and the deferred axes stay unreduced.
        return jax.reshard(w, pt.with_reduced(target, tag))

    def _stack(self, x, w, remat=False, gather=False, drop=False):
        def layer(x, w):
            if gather:
                w = self._gather(w)
            if drop:
                # TAG: a layer weight resharded onto a spec rebuilt from rules (tag lost)
                w = jax.reshard(w, P(None, None))
            return x + jnp.tanh(self._dot("btd,de->bte", x, w)), None

        if remat:
            layer = jax.checkpoint(layer)
        scan = accum.scan_layers if self.prog.variant == "fused" else jax.lax.scan
        x, _ = scan(layer, x, w)
        return x

    def _norm_stack(self, x, w):
        """Scanned norms: each layer scales by its own weight vector."""

        def layer(x, w):
            h = x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + 1e-6)
            return x + h * pt.broadcast_param(w, h), None

        scan = accum.scan_layers if self.prog.variant == "fused" else jax.lax.scan
        x, _ = scan(layer, x, w)
        return x

    def _body(self, i, op, x, p, mb):
        w = p.get(f"w{i}")
        if op in ("dense_tanh", "dense_gelu", "dense_relu"):
            fn = {"dense_tanh": jnp.tanh, "dense_gelu": jax.nn.gelu, "dense_relu": jax.nn.relu}
            return fn[op](self._dot("btd,de->bte", x, w))
        if op == "dense_dropped":
            return jnp.tanh(self._dot("btd,de->bte", x, jax.reshard(w, P(None, None))))
        if op in ("dense_fsdp", "dense_data_sharded"):
            # Named for the oracle: this use's transpose reduces w's at-rest axes by design.
            with jax.named_scope(per_use_scope(f"w{i}")):
                return jnp.tanh(self._dot("btd,de->bte", x, self._gather(w)))
        if op == "dense_fsdp_dropped":
            # Gathered onto a spec rebuilt from rules: the reduced tag is gone, so the
            # backward all-reduces the gradient over every batch axis, 'data' included.
            return jnp.tanh(self._dot("btd,de->bte", x, jax.reshard(w, P(None, None))))
        if op == "stack_fsdp":
            return self._stack(x, w, gather=True)
        if op == "dense_tensor":
            hidden = self._dot("btd,de->bte", x, w, out=P(*self.act[:2], "tensor"))
            return self._dot("bte,ed->btd", jax.nn.gelu(hidden), p[f"v{i}"])
        if op in ("norm", "norm_dropped"):
            h = x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + 1e-6)
            scale = pt.broadcast_param(w, h) if op == "norm" else jax.reshard(w, P())
            return h * scale
        if op == "residual":
            return x + jnp.tanh(self._dot("btd,de->bte", x, w))
        if op in ("stack", "stack_remat", "stack_dropped"):
            return self._stack(x, w, remat=op == "stack_remat", drop=op == "stack_dropped")
        if op == "stack_norm":
            return self._norm_stack(x, w)
        if op == "reshard_activations":
            # Activations through a replicated layout and back: a gather, no reduction.
            return jax.reshard(jax.reshard(x, P()), self.act) * 0.5
        if op == "shard_map_carried":

            def kernel(w, x):
                return x @ pt.to_varying(w, self.batch_axes)

            return jax.shard_map(kernel, in_specs=(pt.spec_of(w), self.act), out_specs=self.act)(
                w, x
            )
        if op == "shard_map_psum_param":

            def kernel(w, x):
                return x @ jax.lax.psum(pt.to_varying(w, self.batch_axes) * 0.5, self.batch_axes)

            return jax.shard_map(kernel, in_specs=(pt.spec_of(w), self.act), out_specs=self.act)(
                w, x
            )
        if op == "shard_map_psum_activations":
            inner = self.batch_axes[-1]

            def kernel(w, x):
                # A per-feature sum over every row: a real reduction over the
                # innermost batch axis each microbatch (the watched one, or not).
                total = jax.lax.psum(jnp.sum(x @ pt.to_varying(w, self.batch_axes), (0, 1)), inner)
                return x, total

            outer = self.batch_axes[:-1]
            # TAG: the sum is invariant over the axis it was summed over only.
            total_spec = P(outer if len(outer) > 1 else (outer[0] if outer else None))
            x, total = jax.shard_map(
                kernel, in_specs=(pt.spec_of(w), self.act), out_specs=(self.act, total_spec)
            )(w, x)
            # Into the loss, not the activations: a sum over rows, so the
            # accumulated gradient is still the full batch's.
            self.extra.append(jnp.sum(total))
            return x
        if op == "batch_contraction":
            # A sum over the batch dimension: reduced over the batch axes in the loop.
            gram = jnp.einsum("btd,bte->de", x, x, out_sharding=P())
            self.extra.append(jnp.sum(gram * pt.broadcast_param(w, gram)) * 1e-2)
            return x
        if op == "take_along":
            picked = jnp.take_along_axis(x, mb["ids"][..., None] % DIM, axis=-1)
            return x + picked
        if op == "at_add":
            return x.at[:, 0].add(1.0)
        raise ValueError(f"unknown body op {op!r}")

    def _loss(self, x, p, mb):
        labels = mb["labels"]
        head = self._gather(p["head"]) if self.fsdp else p["head"]
        logits = self._dot("btd,dv->btv", x, head)
        kind = self.prog.loss
        count = jnp.float32(labels.size)
        if kind == "optax_int_ce":
            return jnp.sum(optax.softmax_cross_entropy_with_integer_labels(logits, labels)), count
        if kind == "optax_onehot_ce":
            onehot = jax.nn.one_hot(labels, VOCAB, dtype=jnp.float32)
            return jnp.sum(optax.softmax_cross_entropy(logits, onehot)), count
        if kind == "log_softmax_take":
            logp = jax.nn.log_softmax(logits, axis=-1)
            return -jnp.sum(jnp.take_along_axis(logp, labels[..., None], axis=-1)), count
        if kind == "masked_mean":
            mask = (labels != 0).astype(jnp.float32)
            losses = optax.softmax_cross_entropy_with_integer_labels(logits, labels)
            return jnp.sum(losses * mask), jnp.sum(mask)
        return jnp.sum(logits * logits), count  # mse against zero

    def loss_fn(self, p: dict, mb: dict) -> tuple[jax.Array, dict]:
        """(loss_sum, {"weight"}) of one microbatch (or the whole batch)."""
        self.extra = []  # loss terms that are sums over rows (batch statistics)
        x = self._embed(p, mb["ids"])
        for i, op in enumerate(self.prog.body):
            x = self._body(i, op, x, p, mb)
        loss_sum, weight = self._loss(x, p, mb)
        for term in self.extra:
            loss_sum = loss_sum + 1e-2 * jax.reshard(term, P())
        if self.prog.penalty:
            # Scaled by the weight so that the accumulated mean equals the full
            # batch's: sum over microbatches of (weight_i * pen) / total weight.
            w = p["head"]
            loss_sum = loss_sum + 1e-2 * weight * 0.5 * jnp.sum(w * w)
        return loss_sum, {"weight": weight}

    # -- accumulation

    def accumulate(self, params, batch, on_tag_lost):
        kw = {"num_microbatches": MICROBATCHES, "on_tag_lost": on_tag_lost}
        if self.prog.variant == "fused":
            kw["schedule"] = "fused"
        if self.prog.variant == "zero1":
            kw["grad_shardings"] = accum.zero1_shardings(params, self.mesh)
        if self.prog.variant == "hierarchical":
            kw["plan"] = accum.plan_for(
                params,
                batch,
                policy=self.policy,
                slice_axes=self.slice_axes,
                per_parameter=self.per_parameter,
            )
        elif self.per_parameter:
            # FSDP: weights sharded over a batch axis reduce it per use (gather's
            # transpose); the plan defers every other batch axis per parameter.
            kw["plan"] = accum.plan_for(params, batch, per_parameter=True)
        return accum.accumulate_gradients(self.loss_fn, params, batch, **kw)

    def plan(self, params) -> accum.ReductionPlan:
        """The plan `accumulate` makes (for start/add/finish, which takes a plan)."""
        return accum.make_plan(
            params,
            batch_axes=self.batch_axes,
            mesh_shape=dict(self.mesh.shape),
            per_parameter=self.per_parameter,
        )

    def per_use_axes(self, params) -> dict[str, set[str]]:
        """Per parameter, the batch axes its gradient is reduced over per use, by
        design (those it is sharded over at rest: the gather's transpose reduces
        them); every other batch axis is deferred for it. Only the parameters
        that have any."""
        axes = {
            name: set(pt.mesh_axes_used(pt.spec_of(leaf))) & set(self.batch_axes)
            for name, leaf in params.items()
        }
        return {name: used for name, used in axes.items() if used}

    def reference(self, params, batch):
        """Full-batch gradients: one pass over the whole batch, no accumulation."""
        loss_sum, aux = self.loss_fn(params, batch)
        del loss_sum
        return jax.grad(lambda p: self.loss_fn(p, batch)[0] / aux["weight"])(params)


# ---------------------------------------------------------------- the oracle

_COMP = re.compile(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$")
_NAMED_CALLS = re.compile(
    r"(?:body|condition|to_apply|calls|branch_computations|called_computations)=\{?([^}\s]+)\}?"
)
_SHAPE = re.compile(r"\b(?:f|bf|s|u)\d+\[([\d,]*)\]")
_TRIPS = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')


def _computations(text: str) -> dict[str, list[str]]:
    comps: dict[str, list[str]] = {}
    current = None
    for line in text.splitlines():
        if current is None:
            m = _COMP.match(line.strip())
            if m and "->" in line:
                current = m.group(1)
                comps[current] = []
        elif line.strip() == "}":
            current = None
        else:
            comps[current].append(line)
    return comps


def _callees(line: str) -> list[str]:
    names = []
    for group in _NAMED_CALLS.findall(line):
        names += [n.strip().lstrip("%") for n in group.split(",") if n.strip()]
    return names


def _reachable(comps: dict[str, list[str]], roots: list[str]) -> set[str]:
    seen, todo = set(), list(roots)
    while todo:
        name = todo.pop()
        if name in seen or name not in comps:
            continue
        seen.add(name)
        for line in comps[name]:
            todo += _callees(line)
    return seen


def _groups(line: str, sizes: dict[str, int]) -> list[list[int]]:
    """Device groups of a replica_groups attribute (list, iota or mesh form)."""
    devices = math.prod(sizes.values())
    m = re.search(r"replica_groups=\{(\{[\d,{}]*\})\}", line)
    if m:
        return [
            [int(d) for d in g.split(",") if d] for g in re.findall(r"\{([\d,]*)\}", m.group(1))
        ]
    m = re.search(r"replica_groups=\[(\d+),(\d+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?", line)
    if m:
        ids = np.arange(devices).reshape([int(d) for d in m.group(3).split(",")])
        if m.group(4):
            ids = ids.transpose([int(d) for d in m.group(4).split(",")])
        return ids.reshape(int(m.group(1)), int(m.group(2))).tolist()
    m = re.search(r"replica_groups=mesh\[([^\]]*)\]\s*\{([^}]*)\}", line)
    if m:
        axes = re.findall(r"'([^']*)'=(\d+)", m.group(1))
        shape = [int(n) for _, n in axes]
        varying = set(re.findall(r"'([^']*)'", m.group(2)))
        ids = np.arange(devices).reshape(shape)
        keep = [i for i, (a, _) in enumerate(axes) if a not in varying]
        vary = [i for i, (a, _) in enumerate(axes) if a in varying]
        ids = ids.transpose(keep + vary).reshape(-1, math.prod(shape[i] for i in vary))
        return ids.tolist()
    return [list(range(devices))]  # no groups: every device


def _spans(group: list[int], sizes: dict[str, int], axis: str) -> bool:
    names = list(sizes)
    stride = math.prod(sizes[a] for a in names[names.index(axis) + 1 :])
    return len({(d // stride) % sizes[axis] for d in group}) > 1


def _backward(op_name: str | None) -> bool:
    """Whether an op_name names a backward op: a gradient is made by a
    transposed op (`transpose(...)` in JAX's name stack), not by a forward op
    nor by a forward op recomputed for the backward pass (`rematted_computation`).
    No op_name counts."""
    if op_name is None:
        return True
    return any(
        re.search(r"transpose\(", part) and not re.search(r"/rematted_computation/", part)
        for part in op_name.split(":")
    )


def _op_name(line: str) -> str | None:
    m = re.search(r'op_name="([^"]*)"', line)
    return None if m is None else m.group(1)


def _operands(line: str, name: str, lines: list[str]) -> list[tuple[int, str | None]]:
    """(elements, op_name) of each array a reduction reduces. XLA combines
    several reductions into one of a tuple; each element's get-tuple-element
    keeps the op_name of the reduction it came from (the combined line's
    op_name joins them all)."""
    m = re.search(r"=\s*(.*?)\s(?:all-reduce|reduce-scatter)(?:-start)?\(", line)
    shapes = [
        math.prod(int(d) for d in dims.split(",") if d) for dims in _SHAPE.findall(m.group(1))
    ]
    if len(shapes) == 1:
        return [(shapes[0], _op_name(line))]
    names: dict[int, str | None] = {}
    for other in lines:
        g = re.search(rf"get-tuple-element\(%?{re.escape(name)}\), index=(\d+)", other)
        if g:
            names[int(g.group(1))] = _op_name(other)
    return [(n, names.get(i, _op_name(line))) for i, n in enumerate(shapes)]


def _by_design(op_name: str | None, axis: str, per_use: dict[str, set[str]]) -> bool:
    """Whether an array is the gradient of a parameter reduced over `axis` per
    use (the backward of its `per_use[<name>]` scope), by design. Every part
    of a combined op_name (`a:b`) must be."""

    def part_by_design(part: str) -> bool:
        used = re.findall(r"per_use\[([\w.]+)\]", part)
        return bool(used) and all(axis in per_use.get(name, ()) for name in used)

    return op_name is not None and all(part_by_design(p) for p in op_name.split(":"))


def oracle_reduces(
    text: str,
    sizes: dict[str, int],
    axis: str,
    whole_program: bool,
    per_use: dict[str, set[str]] | None = None,
) -> bool:
    """Whether an all-reduce / reduce-scatter of an array of more than 8
    elements, the gradient of a parameter that defers `axis`, spans `axis`
    inside the microbatch loop: the ENTRY computation's while loop with trip
    count MICROBATCHES (or anywhere, `whole_program`). `per_use`: per
    parameter, the axes its gradient is reduced over per use by design
    (Model.per_use_axes); such an array does not count, the others in the
    same (combined) reduction still do."""
    per_use = per_use or {}
    comps = _computations(text)
    entry = next(
        n for n in comps if re.search(rf"^ENTRY\s+%?{re.escape(n)}\s", text, re.M) is not None
    )
    if whole_program:
        scope = _reachable(comps, [entry])
    else:
        roots = []
        for line in comps[entry]:
            trips = _TRIPS.search(line)
            if " while(" in line and trips and int(trips.group(1)) == MICROBATCHES:
                roots += _callees(line)
        scope = _reachable(comps, roots)
    for name in scope:
        lines = comps[name]
        for line in lines:
            m = re.search(
                r"%?([\w.\-]+)\s*=\s*.*?\s(?:all-reduce|reduce-scatter)(?:-start)?\(", line
            )
            if not m or not any(_spans(g, sizes, axis) for g in _groups(line, sizes)):
                continue
            for elements, op_name in _operands(line, m.group(1), lines):
                if elements <= MAX_ELEMENTS or _by_design(op_name, axis, per_use):
                    continue
                if _backward(op_name):
                    return True
    return False


# ---------------------------------------------------------------- one program end to end


@dataclasses.dataclass
class Outcome:
    """What one program gave: the verdicts and the gradient error."""

    verdict: bool  # compile_checked raised (here: warned)
    oracle: bool
    trace_time: bool  # the trace-time analysis warned, in a user's own jit
    max_rel_error: float
    message: str


def _compiled_verdict(fn: Callable, *args) -> tuple[object, bool, str]:
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        compiled = accum.compile_checked(fn, *args, on_tag_lost="warn")
    found = [str(w.message) for w in caught if "the compiled step" in str(w.message)]
    return compiled, bool(found), found[0] if found else ""


def _trace_time_warns(fn: Callable, *args) -> bool:
    """Whether tracing `fn` in a plain jax.jit warns. A new function each time:
    jax.jit would reuse the trace compile_checked made of `fn` and warn nothing."""
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        jax.jit(lambda *a: fn(*a)).trace(*args)
    return any("trace-time analysis" in str(w.message) for w in caught)


def run(seed: int, trace_time: bool = False) -> Outcome:
    """Build, compile (checked), run and judge the program drawn from `seed`."""
    model = Model(program(seed))
    sizes = dict(model.mesh.shape)
    with jax.set_mesh(model.mesh):
        params, batch = model.params(), model.batch()
        if model.prog.variant == "add":
            return _run_add(model, params, batch, sizes, trace_time)

        def step(p, b):
            _, _, grads = model.accumulate(p, b, "warn")
            return grads, model.reference(p, b)

        compiled, verdict, message = _compiled_verdict(step, params, batch)
        grads, reference = compiled(params, batch)
        warned = _trace_time_warns(step, params, batch) if trace_time else False
    text = compiled.as_text()
    oracle = oracle_reduces(
        text, sizes, model.watched, whole_program=False, per_use=model.per_use_axes(params)
    )
    return Outcome(verdict, oracle, warned, _max_rel_error(grads, reference), message)


def _run_add(model, params, batch, sizes, trace_time) -> Outcome:
    """start / add per microbatch / finish; the compiled add is the one checked."""
    microbatches = accum.split_microbatches(batch, MICROBATCHES)
    first = jax.tree.map(lambda x: x[0], microbatches)
    # FSDP's per-parameter plan is passed whole; otherwise start makes the default one.
    plan = model.plan(params) if model.per_parameter else None
    start = functools.partial(accum.start, plan=plan)
    acc = jax.jit(start, static_argnums=0)(model.loss_fn, params, first)
    add = jax.jit(accum.add, static_argnums=1)
    compiled, verdict, message = _compiled_verdict(add, acc, model.loss_fn, params, first)
    for i in range(MICROBATCHES):
        acc = compiled(acc, params, jax.tree.map(lambda x, i=i: x[i], microbatches))
    _, _, grads = jax.jit(accum.finish)(acc)
    reference = jax.jit(model.reference)(params, batch)
    if trace_time:
        warned = _trace_time_warns(
            lambda a, p, m: accum.add(a, model.loss_fn, p, m), acc, params, first
        )
    else:
        warned = False
    oracle = oracle_reduces(
        compiled.as_text(),
        sizes,
        model.watched,
        whole_program=True,
        per_use=model.per_use_axes(params),
    )
    return Outcome(verdict, oracle, warned, _max_rel_error(grads, reference), message)


def _max_rel_error(grads, reference) -> float:
    worst = 0.0
    for g, r in zip(jax.tree.leaves(grads), jax.tree.leaves(reference), strict=True):
        g, r = np.asarray(g, np.float64), np.asarray(r, np.float64)
        worst = max(worst, float(np.max(np.abs(g - r)) / (np.max(np.abs(r)) + 1e-6)))
    return worst


def replay_command(seed: int) -> str:
    """The command that rebuilds and judges one program on its own."""
    return (
        "JAX_PLATFORMS=cpu XLA_FLAGS=--xla_backend_optimization_level=0 "
        f"uv run python packages/accum/tests/guard_generator.py {seed}"
    )


if __name__ == "__main__":
    import sys

    jax.config.update("jax_num_cpu_devices", 8)
    for arg in sys.argv[1:]:
        print(program(int(arg)).describe())
        print(run(int(arg), trace_time=True))
