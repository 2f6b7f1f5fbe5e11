"""A whole run: validate, build mesh and model, compile once, train, report.

Takes the whole Config: it is the wiring that hands each module the groups it reads.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import accum
from trainer import data
from trainer import model as model_lib
from trainer.config import DCN_AXES, Config, ConfigError, ParallelismConfig
from trainer.data import eval_data, eval_schedule, input_pipeline, sft_data
from trainer.io import checkpoint, initial_weights, stop_signals
from trainer.io import metrics as metrics_lib
from trainer.model import attention_kernel, flops
from trainer.run import evaluate, report, xla_options
from trainer.run.spec import RunSpec, check_built, resolve
from trainer.sharding import slices
from trainer.step import reduction_choice
from trainer.step.optimizer import make_optimizer
from trainer.step.train_step import make_step


@dataclasses.dataclass
class Run:
    """A built run: its spec (every decision, run/spec.py), its state and jitted step,
    and what the loop adds as it goes (data, checkpoints, the compiled step)."""

    spec: RunSpec
    state: dict
    step_fn: Any  # jitted
    compiled: Any = None
    source: Any = None  # input_pipeline.Source
    checkpoints: checkpoint.Checkpointer | None = None
    start_step: int = 0  # > 0 when resumed from a checkpoint
    restored_from: str = ""
    initialized_from: str = ""  # the initial weights' origin when not drawn at random
    stop_reason: str = ""  # set when a signal stopped the loop early
    evaluator: evaluate.Evaluator | None = None  # eval_interval > 0
    evals: list = dataclasses.field(default_factory=list)  # (step, eval result) per evaluation

    # The spec's decisions, read through the run (they never change after resolve).
    config = property(lambda self: self.spec.config)
    ctx = property(lambda self: self.spec.ctx)
    model = property(lambda self: self.spec.model)
    batch_size = property(lambda self: self.spec.batch_size)
    plan = property(lambda self: self.spec.plan)
    reduction_choice = property(lambda self: self.spec.choice)

    @property
    def deferral_axes(self) -> tuple[str, ...]:
        """Axes some gradient is reduced over once per step (a read of the plan)."""
        return self.plan.deferred_axes if self.plan else ()


def setup(config: Config, devices: list | None = None) -> Run:
    """Resolve (every check before anything is compiled), then `start`."""
    return start(resolve(config, devices if devices is not None else jax.devices()))


def start(spec: RunSpec) -> Run:
    """Open the inputs and the output directory, build the state and jit the step,
    and restore the newest checkpoint (or load the initial weights)."""
    config = spec.config
    # Inputs and the output directory, before building or compiling anything.
    source = input_pipeline.make_source(config, spec.batch_size)
    if config.num_epochs:
        # The step count follows the rows (transformers' num_train_epochs): fixed here,
        # before the schedule is built and the config saved with the checkpoints.
        if getattr(source, "packed", None) is None:
            raise ConfigError(
                f"num_epochs={config.num_epochs} needs a data set of known size (text, hf or "
                "use_sft rows); this source streams without end: set steps="
            )
        rows = len(source.packed)
        steps = math.ceil(config.num_epochs * rows / spec.batch_size)
        config = dataclasses.replace(config, steps=steps)
        spec = dataclasses.replace(spec, config=config)
        source.note = (
            f"; num_epochs={config.num_epochs}: {rows} rows / {spec.batch_size} a step "
            f"-> steps={steps}"
        )
    eval_set = eval_data.make_eval_set(config, len(spec.devices), spec.mesh_shape)
    checkpoints = checkpoint.open_checkpointer(config, spec.batch_size)
    # A run with checkpoints of its own resumes from them: never from its initial weights,
    # except for a LoRA run's frozen base, which its checkpoints do not hold.
    resuming = bool(checkpoints and checkpoints.manager.latest_step() is not None)
    weights = (
        None
        if resuming and not config.lora_rank
        else initial_weights.source(config.model, config.checkpointing)
    )
    run = build(spec, weights=weights)
    run.source, run.checkpoints = source, checkpoints
    run.evaluator = evaluate.make_evaluator(
        config.parallelism, config.data, config.evaluation, run.ctx, run.model, eval_set
    )
    restored = None
    if checkpoints:
        checkpoints.check_space(run.state)
        restored = checkpoints.restore_latest(run.state, run.ctx.mesh)
    if restored:
        run.state, run.start_step, run.restored_from = restored.state, restored.step, restored.path
    if weights and (not restored or run.model.lora):
        frozen = "frozen base (LoRA): " if run.model.lora else ""
        run.initialized_from = frozen + weights.describe()
    return run


def _optimizer_layout(parallelism: ParallelismConfig, mesh, tx, params) -> tuple[Any, Any, Any]:
    """(params, optimizer-state shardings, zero1) for `make_step`; `params` may be
    arrays or ShapeDtypeStructs (abstract_setup). Without ZeRO-1 nothing moves."""
    if not parallelism.shard_optimizer_over_data:
        # Adam's moments laid out like the parameters. Explicit mode infers this
        # from the types; auto mode would otherwise let XLA pick, and it
        # replicated them under FSDP (4x the state memory on fsdp=8).
        param_shardings = jax.tree.map(lambda p: p.sharding, params)
        opt_shardings = accum.zero1_state_shardings(
            jax.eval_shape(tx.init, params), params, param_shardings, mesh
        )
        return params, opt_shardings, None
    # ZeRO-1: master params and optimizer state sharded over 'data'.
    compute_shardings = jax.tree.map(lambda p: p.sharding, params)
    master_shardings = accum.zero1_shardings(params, mesh, fsdp_axes=("fsdp", "dcn_fsdp"))
    params = jax.tree.map(
        lambda p, s: (
            jax.ShapeDtypeStruct(p.shape, p.dtype, sharding=s)
            if isinstance(p, jax.ShapeDtypeStruct)
            else jax.device_put(p, s)
        ),
        params,
        master_shardings,
    )
    opt_shardings = accum.zero1_state_shardings(
        jax.eval_shape(tx.init, params), params, master_shardings, mesh
    )
    return params, opt_shardings, (compute_shardings, master_shardings)


def jit_step(step: Callable, state: dict) -> Any:
    """jit the step with the new state pinned to the old state's shardings.

    In auto mode XLA chooses output shardings freely (it returned FSDP optimizer
    state replicated), and the next call, compiled for the input shardings,
    would then reject its own output. Pinning also lets the donated buffers be
    reused in place.
    """
    state_shardings = jax.tree.map(lambda x: x.sharding, state)
    return jax.jit(step, donate_argnums=(0,), out_shardings=(state_shardings, None))


def abstract_setup(config: Config, devices: list) -> Run:
    """What `setup` builds, with the state as ShapeDtypeStructs carrying their
    shardings: nothing is initialised or allocated, no data source is opened.
    For AOT compiles (aot.py), where `devices` are a TPU topology's
    compile-only devices; lower with `abstract_batch(run)`."""
    return build(resolve(config, devices), abstract=True)


def build(
    spec: RunSpec, *, abstract: bool = False, weights: initial_weights.Source | None = None
) -> Run:
    """State and the jitted step for `spec`; decides nothing (the spec did).

    `abstract`: the state as ShapeDtypeStructs carrying their shardings (nothing
    initialised or allocated); else initialised on the mesh, from `weights` when
    given (a HF directory, another run's checkpoint), drawn at random otherwise.
    """
    config, ctx, model = spec.config, spec.ctx, spec.model
    if abstract:
        params, router = model_lib.abstract_state(model, ctx)
    elif weights:
        params, router = weights.load(config, ctx, model)
    else:
        params, router = model_lib.init(ctx, model, config.seed)
    frozen = None
    if model.lora:
        # The parameters become the frozen base; the adapters are what the step trains.
        frozen = params
        params = spec.trained if abstract else model_lib.init_adapters(ctx, model, config.seed)
    check_built(spec, params)  # the plan and the auto decision were made for these
    tx = make_optimizer(config.training)
    params, opt_shardings, zero1 = _optimizer_layout(config.parallelism, ctx.mesh, tx, params)
    fns = make_step(
        config.model, config.training, config.accumulation, ctx, model, tx, zero1, spec.plan
    )
    with jax.set_mesh(ctx.mesh):
        init = jax.jit(fns.init_opt_state, out_shardings=opt_shardings)
        opt_state = jax.eval_shape(init, params) if abstract else init(params)
    # On the mesh (replicated) like the rest of the state, so the step's pinned
    # output shardings all live on one device set.
    replicated = NamedSharding(ctx.mesh, P())
    if abstract:
        step = jax.ShapeDtypeStruct((), jnp.int32, sharding=replicated)
    else:
        step = jax.device_put(jnp.zeros((), jnp.int32), replicated)
    state = {"params": params, "opt_state": opt_state, "router": router, "step": step}
    if frozen is not None:
        state["frozen"] = frozen
    return Run(spec, state, jit_step(fns.step, state))


def abstract_batch(run: Run) -> dict:
    """ShapeDtypeStructs of one global batch, sharded as the loop's batches are."""
    shape = (run.batch_size, run.config.max_target_length)
    shardings = data.batch_shardings(run.ctx, *shape)
    return {
        key: jax.ShapeDtypeStruct(shape, jnp.float32 if key == "weights" else jnp.int32, sharding=s)
        for key, s in shardings.items()
    }


def batch_for(run: Run, step: int) -> dict:
    return input_pipeline.put_rows(run.source, step, run.ctx, run.config.max_target_length)


def compile_step(run: Run) -> Any:
    """Lower and compile the step once (the same executable the loop runs), and
    raise TagLostError if the compiled step reduces a deferred axis inside the
    microbatch loop (accum.compile_checked: the verdict is the executable's)."""
    with jax.set_mesh(run.ctx.mesh):
        run.compiled = accum.compile_checked(
            run.step_fn,
            run.state,
            batch_for(run, 0),
            compiler_options=xla_options.for_mesh(run.config.parallelism, run.ctx.mesh),
        )
    if run.evaluator:
        run.evaluator.compile(run.state)
    return run.compiled


def to_host(metrics: dict) -> dict:
    out = {}
    for key, value in metrics.items():
        array = np.asarray(value)
        out[key] = array.tolist() if array.ndim else float(array)
    return out


def train(
    run: Run,
    on_step: Callable[[int, dict], None] | None = None,
    on_eval: Callable[[int, dict], None] | None = None,
) -> list[dict]:
    """Run `config.steps` steps; returns one host-side metrics dict per step.

    With evaluation on, `run.evals` gets (step, result) after every eval step,
    and `on_eval(step, result)` is called once the evaluation is complete (never
    for half of one). A run resumed at an eval step evaluates again first: a kill
    during that evaluation left no record of it, and the same parameters give the
    same result.
    """
    config = run.config
    compiled = run.compiled or compile_step(run)
    tokens_per_step = run.batch_size * config.max_target_length
    flops_per_step = flops.training_flops_per_token(config.model, config.data) * tokens_per_step
    peak = flops.peak_tflops(config.output, jax.devices()[0].device_kind)
    history = []
    checkpoints = run.checkpoints

    def maybe_evaluate(step: int) -> None:
        if run.evaluator and eval_schedule.due(config.training, config.evaluation, step):
            result = run.evaluator.evaluate(run.state)
            run.evals.append((step, result))
            if on_eval:
                on_eval(step, result)

    with jax.set_mesh(run.ctx.mesh), stop_signals.stop_on_signals() as stop:
        try:
            if run.start_step:
                maybe_evaluate(run.start_step)
            for step in range(run.start_step, config.steps):
                batch = batch_for(run, step)
                start = time.perf_counter()
                run.state, metrics = compiled(run.state, batch)
                metrics = to_host(jax.block_until_ready(metrics))
                bias = routing_bias(run.state)
                if bias is not None:
                    # Read from the new state on the host: no output added to the program.
                    metrics["routing_bias"] = metrics_lib.bias_stats(bias)
                seconds = time.perf_counter() - start
                metrics.update(
                    step=step + 1, step_time_s=seconds, tokens_per_s=tokens_per_step / seconds
                )
                if peak:
                    devices = run.ctx.mesh.size
                    metrics["mfu"] = flops_per_step / seconds / (peak * 1e12 * devices)
                for key in ("loss", "grad_norm"):
                    # Before any save: the last good checkpoint stays the newest.
                    if not np.isfinite(metrics[key]):
                        raise FloatingPointError(
                            f"{key} is {metrics[key]} at step {step + 1}; stopping"
                        )
                history.append(metrics)
                if checkpoints:
                    checkpoints.raise_if_failed()  # a failed background save stops the run
                if checkpoints and checkpoints.should_save(step + 1):
                    checkpoints.save(step + 1, run.state)
                if on_step:
                    on_step(step + 1, metrics)
                # After the step's checkpoint: a kill during evaluation resumes at
                # this step and evaluates again (above). A stop request skips it: the
                # checkpoint saved below is of this step, so the resumed run evaluates.
                if not stop.requested:
                    maybe_evaluate(step + 1)
                if stop.requested:
                    if checkpoints:
                        checkpoints.save(step + 1, run.state)  # no-op when just saved
                    saved = f"; checkpoint saved in {checkpoints.directory}" if checkpoints else ""
                    run.stop_reason = f"{stop.signal_name}: stopped after step {step + 1}{saved}"
                    break
        finally:
            if checkpoints:
                checkpoints.wait()  # a pending async save completes, even on an error
                # (CheckpointSaveError if it failed, its leftovers removed)
    return history


def routing_bias(state: dict) -> np.ndarray | None:
    """The main MoE layers' routing bias (L, E) on the host, or None without MoE layers."""
    bias = state.get("router", {}).get("moe_layers", {}).get("ffn", {}).get("bias")
    return None if bias is None else np.asarray(jax.device_get(bias))


def moe_figures(m: dict) -> str:
    """The step line's MoE part: the worst layer's max/mean load and, with a
    capacity_factor, the share of assignments dropped (the layers' mean)."""
    if "tokens_per_expert" not in m:
        return ""
    text = f"  imbalance {max(metrics_lib.load_imbalance(m['tokens_per_expert'])):.2f}"
    if "dropped_share" in m:
        shares = np.atleast_1d(np.asarray(m["dropped_share"], dtype=np.float64))
        text += f"  dropped {shares.mean() * 100:.2f}%"
    if "router_z_loss" in m:
        text += f"  z {m['router_z_loss']:.3f}"
    return text


def has_aux_terms(model) -> bool:
    """Whether the loss adds anything to the cross-entropy: a balance loss, a router
    z-loss (MoE layers) or multi-token prediction."""
    moe = model.num_moe_layers > 0
    return bool(
        (moe and (model.load_balance_loss_weight or model.moe_z_loss_coeff)) or model.mtp_num_layers
    )


def step_line(step: int, m: dict, counted: bool = False, aux: bool = False) -> str:
    """The console line of one step; `counted` (use_sft) adds the step's counted tokens,
    the loss's denominator; `aux` (has_aux_terms) the loss's parts: the cross-entropy
    and the auxiliary terms added to it (loss - ce: balance, z-loss, MTP)."""
    mfu = f"  mfu {m['mfu'] * 100:5.1f}%" if "mfu" in m else ""
    if counted:
        mfu += f"  counted {m['tokens']:,.0f}"
    depths = metrics_lib.mtp_losses(m)
    mtp = ""
    if (aux or depths) and "ce_loss" in m:
        mtp = f"  ce {m['ce_loss']:.4f}  aux {m['loss'] - m['ce_loss']:.4f}"
    if depths:
        # Each depth's cross-entropy (the loss adds them, scaled: part of aux).
        mtp += "  mtp " + " ".join(f"{loss:.4f}" for _, loss in depths)
    return (
        f"step {step:5d}  loss {m['loss']:.4f}{mtp}{moe_figures(m)}  "
        f"grad_norm {m['grad_norm']:.3f}  "
        f"lr {m['learning_rate']:.2e}  {m['tokens_per_s']:,.0f} tokens/s  "
        f"{m['step_time_s'] * 1000:.0f} ms{mfu}"
    )


def startup_lines(run: Run) -> list[str]:
    """Mesh, parameter counts and the compiled step's collective summary."""
    config = run.config
    sizes = dict(run.ctx.mesh.shape)
    lines = [
        report.mesh_line(sizes, config.shard_mode),
        report.params_line_of(config.model, run.state.get("frozen", run.state["params"])),
        *report.lora_lines(config.model, run.state),
        report.batch_line(config.accumulation, config.data, run.batch_size),
        *report.pipeline_lines(config, dict(run.ctx.mesh.shape)),
    ]
    if run.reduction_choice:
        lines += reduction_choice.startup_lines(run.reduction_choice)
    lines += report.plan_lines(config.accumulation, run.plan)
    lines += report.capacity_lines(config, run.ctx, run.batch_size)
    lines.append(attention_kernel.describe(config.model, run.ctx, config.data.max_target_length))
    lines += report.grouped_matmul_lines(config, run.ctx)
    lines += report.gemm_lines(config, run.ctx)
    lines += data_lines(run)
    text = run.compiled.as_text()
    return lines + report.collective_summary(
        text, config.accumulation, *summary_axes(run), shard_mode=config.shard_mode
    )


def summary_axes(
    run: Run,
) -> tuple[dict[str, int], tuple[str, ...], tuple[str, ...], list[int] | None]:
    """(mesh shape, axes no in-loop gradient reduction may span, slice axes, the slice
    of each device in the mesh's order or None) for the summary: the plan's strict
    axes (those every gradient reduces once per step). The slices are given where
    the expert axis crosses them: a slice is then no contiguous block of the mesh."""
    shape, across = dict(run.ctx.mesh.shape), run.plan.slice_axes
    where = None
    if "expert" in across:
        count = math.prod(shape[a] for a in DCN_AXES) * math.prod(dict(run.ctx.dcn_parts).values())
        where = slices.slice_of(run.ctx.mesh.devices, count)
    return shape, run.plan.strict_axes, across, where


def hlo_report_command(run: Run, path: str) -> str:
    """The `hlo-report` command line that judges a dump of this run's step as the
    startup summary does (mesh axes of size one left out: they move no device)."""
    mesh_shape, strict, across, _ = summary_axes(run)
    mesh = ",".join(f"{a}={n}" for a, n in mesh_shape.items() if n > 1)
    args = [f"--mesh {mesh}"] if mesh else []
    args += [f"--over {a}" for a in strict]
    if across and "expert" not in across:  # its slices are no blocks of ids (summary_axes)
        args.append(f"--slices {math.prod(mesh_shape[a] for a in across)}")
    return " ".join(["hlo-report", path, *args])


def data_lines(run: Run) -> list[str]:
    """Where batches come from, where checkpoints go, and where the run resumes."""
    lines = [run.source.describe()] if run.source else []
    if run.config.use_sft:
        lines.append(sft_data.loss_line(run.config.data))
    if run.evaluator:
        lines.append(run.evaluator.describe())
    if run.checkpoints:
        lines.append(run.checkpoints.describe())
        if run.restored_from:
            lines.append(f"resumed from {run.restored_from} at step {run.start_step}")
    else:
        lines.append(report.checkpoints_off_line(run.config))
    if run.initialized_from:
        lines.append(f"initial weights: {run.initialized_from}")
    return lines
