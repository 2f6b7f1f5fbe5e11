"""The run's keys, one dataclass per group: parallelism, training, accumulation,
data, evaluation, checkpointing, output."""

from __future__ import annotations

import dataclasses
from typing import Literal

from accum import POLICIES, SCHEDULES
from pspec_tags import MODES as SHARD_MODES
from trainer.config.keys import (
    DCN_AXES,
    ICI_AXES,
    key,
)


@dataclasses.dataclass(frozen=True)
class ParallelismConfig:
    """Devices, the mesh, sharding, and how the program is compiled for them."""

    # Parallelism: -1 fills the devices left over (ici_: within a slice; dcn_: across
    # slices, filling num_slices). num_slices=-1: detected (1 on one slice or CPU; set
    # it to emulate slices on CPU devices, e.g. num_slices=2 on 8 devices = 2 x 4).
    num_slices: int = key(-1, "slices (-1: detected; set it to emulate slices on CPU)")
    dcn_data_parallelism: int = key(-1, "cross-slice data parallelism (-1: fills the slices)")
    dcn_fsdp_parallelism: int = key(1, "cross-slice FSDP")
    # OTHER_DCN_KEYS: MaxText's names, accepted; anything but 1 stops before compiling.
    dcn_fsdp_transpose_parallelism: int = key(1, "MaxText's; must be 1")
    dcn_sequence_parallelism: int = key(1, "MaxText's; must be 1")
    dcn_context_parallelism: int = key(1, "MaxText's; must be 1")
    dcn_context_autoregressive_parallelism: int = key(1, "MaxText's; must be 1")
    dcn_tensor_parallelism: int = key(1, "MaxText's; must be 1")
    dcn_tensor_transpose_parallelism: int = key(1, "MaxText's; must be 1")
    dcn_tensor_sequence_parallelism: int = key(1, "MaxText's; must be 1")
    dcn_pipeline_parallelism: int = key(
        1, "pipeline stages across slices (the 'stage' axis' cross-slice part)"
    )
    dcn_expert_parallelism: int = key(
        1, "experts across slices/hosts (the 'expert' axis' cross-slice part)"
    )
    dcn_autoregressive_parallelism: int = key(1, "MaxText's; must be 1")
    dcn_diloco_parallelism: int = key(1, "MaxText's; must be 1")
    ici_data_parallelism: int = key(-1, "in-slice data parallelism (-1: fills the devices)")
    ici_fsdp_parallelism: int = key(1, "in-slice FSDP (parameters sharded over 'fsdp')")
    ici_tensor_parallelism: int = key(1, "in-slice tensor parallelism")
    ici_tensor_transpose_parallelism: int = key(1, "in-slice transposed tensor parallelism")
    ici_context_parallelism: int = key(1, "in-slice context (sequence) parallelism")
    ici_expert_parallelism: int = key(1, "in-slice expert parallelism")
    # Pipeline parallelism (model/pipeline.py, docs/training.md "Pipeline parallelism"),
    # MaxText's keys: the MoE layers split into ici x dcn pipeline stages on the
    # 'stage' mesh axis. The pipeline's microbatches are the gradient accumulation's
    # (-1: gradient_accumulation_steps of them); num_pipeline_repeats > 1: circular
    # stages, each holding that many non-contiguous chunks of layers.
    ici_pipeline_parallelism: int = key(1, "in-slice pipeline stages (the 'stage' axis)")
    num_pipeline_microbatches: int = key(
        -1, "microbatches through the pipeline per step (-1: gradient_accumulation_steps)"
    )
    num_pipeline_repeats: int = key(
        1, "layer chunks per stage: 1 GPipe, > 1 circular (interleaved) stages"
    )
    expert_shard_attention_option: Literal["fsdp", "context"] = key(
        "fsdp", "what the expert axis shards in attention layers"
    )
    shard_mode: Literal[SHARD_MODES] = key(
        "explicit", "explicit sharding (tags, deferred reductions) or auto (GSPMD)"
    )
    shard_optimizer_over_data: bool = key(
        False, "ZeRO-1: optimizer state and update sharded over the data axes"
    )
    # On TPU, compile with XLA's asynchronous all-reduce collective fusions and no
    # all-reduce combining (trainer/run/xla_options.py), so an all-reduce can be an async
    # start/done pair with compute scheduled between. Only all-reduces are touched:
    # reduce-scatters (ZeRO-1's) and overlapped_ring's collective-permutes compile
    # the same with it on and off. What it changes per topology and schedule (memory,
    # the async share of the gradient reductions), measured:
    # benchmarks/results/perf_keys.md and aot_async.md. Off by default. No effect on
    # CPU and GPU.
    tpu_async_collectives: bool = key(
        False,
        "TPU: XLA options for uncombined, async all-reduces (what they change, measured: "
        "benchmarks/results/perf_keys.md)",
    )
    # On GPUs, matmuls as cuBLAS(Lt) calls, not XLA's Triton GEMM fusions
    # (xla_gpu_enable_triton_gemm=false, as NVIDIA's JAX containers set it): cuBLAS
    # takes an add of the product's shape as its C operand (beta=1), so a residual
    # add or a gradient added into its accumulator runs inside the GEMM instead of
    # in a kernel of its own (trainer/run/xla_options.py; what it changes in the
    # deviceless H200 estimate: benchmarks/results/gpu_estimate.md). No effect on
    # CPU and TPU.
    gpu_gemm: Literal["cublas", "triton"] = key(
        "cublas", "GPU: matmuls as cuBLAS calls (adds fused as C) or XLA's Triton GEMMs"
    )
    # The platform to run on, under MaxText's key: "" = JAX's default (an accelerator
    # where there is one), cpu (the CPU backend with --num_cpu_devices virtual
    # devices, even beside an accelerator), tpu, gpu (gpu_multiprocess: the same).
    hardware: Literal["", "cpu", "tpu", "gpu", "gpu_multiprocess"] = key(
        "", "platform to run on ('': JAX's default)"
    )
    # Never join a process group (MaxText's key): one process even on a detected
    # cluster or with JAX_COORDINATOR_ADDRESS set (distributed.py).
    skip_jax_distributed_system: bool = key(False, "never join a multi-process group")
    # AOT (aot.py): compile the step for a TPU or GPU topology on this host, do not train.
    compile_topology: str = key(
        "", "AOT: compile for this TPU or GPU topology (e.g. v5e-8, h100-8), no training"
    )
    compile_topology_num_slices: int = key(
        1, "AOT: slices (TPU) or hosts (GPU) of compile_topology"
    )

    def ici_parallelism(self) -> dict[str, int]:
        """Requested size per in-slice mesh axis (before -1 is filled); 'pipeline':
        the in-slice part of the 'stage' axis."""
        sizes = {axis: getattr(self, f"ici_{axis}_parallelism") for axis in ICI_AXES}
        return {"pipeline": self.ici_pipeline_parallelism, **sizes}

    def dcn_parallelism(self) -> dict[str, int]:
        """Requested size per cross-slice mesh axis (before -1 is filled);
        'dcn_pipeline', 'dcn_expert': the cross-slice parts of the 'stage' and
        'expert' axes (HYBRID_AXES)."""
        sizes = {
            axis: getattr(self, f"dcn_{axis.removeprefix('dcn_')}_parallelism") for axis in DCN_AXES
        }
        return {
            "dcn_pipeline": self.dcn_pipeline_parallelism,
            **sizes,
            "dcn_expert": self.dcn_expert_parallelism,
        }


LR_SCHEDULERS = ("cosine", "linear", "constant")  # transformers' lr_scheduler_type names


@dataclasses.dataclass(frozen=True)
class TrainingConfig:
    """The optimizer, its schedule, the step count and the seed."""

    steps: int = key(10, "optimizer steps")
    learning_rate: float = key(3e-3, "peak learning rate")
    warmup_steps_fraction: float = key(0.1, "share of steps in linear warmup")
    # transformers' TrainingArguments names: warmup_steps wins over the fraction when
    # set; lr_scheduler_type after the warmup (step/optimizer.py).
    warmup_steps: int = key(-1, "linear warmup steps (-1: warmup_steps_fraction x steps)")
    # transformers' num_train_epochs for text and SFT data: steps follow the row count.
    num_epochs: int = key(
        0, "passes over the packed rows: steps = ceil(num_epochs x rows / global batch) (0: steps)"
    )
    lr_scheduler_type: str = key(
        "cosine", "after the warmup: cosine (to cosine_final_lr_fraction), linear (to 0), constant"
    )
    cosine_final_lr_fraction: float = key(0.1, "final learning rate / peak (cosine decay)")
    adam_b1: float = key(0.9, "AdamW beta1")
    adam_b2: float = key(0.95, "AdamW beta2")
    adam_eps: float = key(1e-8, "AdamW epsilon")
    adam_weight_decay: float = key(0.1, "AdamW weight decay")
    # Adam's moments' storage dtypes ('': each parameter's dtype, weight_dtype):
    # mu_dtype is MaxText's key (the first moment), nu_dtype ours (the second).
    # bfloat16 halves their bytes and the optimizer's memory traffic; each step's
    # update is computed in float32 and rounded once (step/adam_moments.py), as
    # DeepSeek-V3 keeps both in bf16 (its report, 3.3.2). A bf16 moment decays by
    # beta per step only while 1 - beta >= 2^-8 (half a bf16 spacing): with
    # adam_b2=0.999, b2 x nu rounds back to nu and the second moment never decays,
    # so bfloat16 is refused there (trainer.config.validate).
    mu_dtype: Literal["", "float32", "bfloat16"] = key(
        "", "AdamW first moment dtype ('': the parameters'; bfloat16 needs 1 - adam_b1 >= 2^-8)"
    )
    nu_dtype: Literal["", "float32", "bfloat16"] = key(
        "",
        "AdamW second moment dtype ('': the parameters'; bfloat16 needs 1 - adam_b2 >= 2^-8: "
        "below, b2 x nu rounds back to nu in bf16 and it never decays)",
    )
    gradient_clipping_threshold: float = key(1.0, "global gradient norm clip (<= 0: off)")
    seed: int = key(0, "seed of the initial weights and the data order")


@dataclasses.dataclass(frozen=True)
class AccumulationConfig:
    """Microbatches and when, where and how each gradient is reduced."""

    gradient_accumulation_steps: int = key(1, "microbatches per optimizer step")
    # When each gradient is reduced (accum.plan): deferred (once per step over every
    # batch axis), per_microbatch, or hierarchical (cross-slice axes once per step,
    # in-slice ones reduce-scattered per microbatch into sharded accumulators).
    # auto (the default): the policy accum.cost predicts fastest that fits in HBM
    # (trainer/step/reduction_choice.py).
    gradient_reduction_policy: Literal[("auto", *POLICIES)] = key(
        "auto", "when each gradient is reduced (auto: the fastest that fits)"
    )
    # The chip whose figures (accum.hardware) auto's cost model uses: v4, v5e, v5p,
    # v6e, h100, h200. Empty: compile_topology's chip, else the devices' kind.
    reduction_hardware: str = key("", "chip whose figures auto's cost model uses")
    # The gradient accumulator's dtype (the scan carry summing microbatches):
    # bfloat16 halves its memory and the bytes of the deferred reductions, which
    # reduce the accumulator; sums then differ from float32's by bf16 rounding.
    accum_dtype: Literal["float32", "bfloat16"] = key(
        "float32",
        "gradient accumulator dtype: bfloat16 halves it and the bytes of its deferred "
        "reduction (benchmarks/results/perf_keys.md)",
    )
    # Print the reduction plan (parameter group x mesh axis -> when) at startup.
    print_reduction_plan: bool = key(False, "print the reduction plan at startup")
    # Where each step adds up and reduces the gradients (accum/schedule.py; same numbers):
    # plain (add each microbatch's gradient after its backward), fused (the default: add
    # each layer's inside the backward layer scan, no full-size per-microbatch gradient;
    # no effect without scan_layers or with per_microbatch: accum.fuses_in_scan;
    # benchmarks/results/aot_fused.md, fused_cpu.md), overlapped (fused, and the last
    # microbatch reduces each layer inside its backward, under the remaining layers'
    # compute where XLA runs those reductions asynchronously, which v5e does not for
    # ZeRO-1's reduce-scatters: perf_keys.md; needs scan_layers), overlapped_ring
    # (overlapped, reductions onto ZeRO-1 shards as rings of collective-permutes, which
    # XLA:TPU runs asynchronously with or without tpu_async_collectives where it keeps
    # reduce-scatters synchronous on v5e: perf_keys.md, aot_async.md; explicit mode,
    # not with per_microbatch).
    gradient_accumulation_schedule: Literal[SCHEDULES] = key(
        "fused",
        "how microbatch gradients are added and reduced: plain, fused (no full-size "
        "per-microbatch gradient), overlapped (per-layer reductions in the last backward), "
        "overlapped_ring (those as async permute rings) (benchmarks/results/perf_keys.md)",
    )


@dataclasses.dataclass(frozen=True)
class DataConfig:
    """The training data: what is read, how it is tokenized, batch and sequence size."""

    per_device_batch_size: float = key(1.0, "sequences per device per microbatch")
    max_target_length: int = key(32, "sequence length in tokens")
    # Data (input_pipeline.py, text_data.py, hf_data.py): synthetic; text: .txt/.jsonl
    # files (a directory or glob); hf: local parquet files. Byte tokens unless
    # tokenizer_path names a tokenizer.json.
    dataset_type: Literal["synthetic", "text", "hf"] = key(
        "synthetic", "synthetic tokens, text (.txt/.jsonl) files, or hf (local parquet)"
    )
    dataset_path: str = key("", "text: a directory or glob of .txt/.jsonl files")
    jsonl_field: str = key("text", "text: the .jsonl field holding the document")
    tokenizer_path: str = key("", "a tokenizer.json ('': byte tokens)")
    # dataset_type=hf, under MaxText's names: hf_train_files / hf_eval_files are parquet
    # files (a glob, a file, or a directory of *.parquet); train_data_columns /
    # eval_data_columns (empty: the train column) the one column read, `text` or
    # MaxText's `['text']`: text (tokenized with the run's tokenizer, end-of-document
    # appended) or token ids (a list of integers, taken as they are). hf_path: MaxText's
    # loader name, "parquet" or empty (no Hub streaming here).
    hf_path: str = key("", "hf: MaxText's loader name, 'parquet' or empty (no Hub streaming)")
    hf_train_files: str = key(
        "", "hf: training parquet files (glob, file or directory; use_sft: .jsonl too)"
    )
    hf_eval_files: str = key(
        "", "hf: evaluation parquet files (glob, file or directory; use_sft: .jsonl too)"
    )
    train_data_columns: str = key("text", "hf: the column read (text or token ids)")
    eval_data_columns: str = key("", "hf: the eval column ('': train_data_columns)")
    # Supervised fine-tuning (sft_data.py, docs/finetune.md), under MaxText's keys: with
    # dataset_type=hf, hf_train_files / hf_eval_files are .jsonl or .parquet rows of
    # `messages` (role/content; the column: train_data_columns unless left at `text`),
    # rendered with the checkpoint's chat template and tokenized with its tokenizer.json
    # (hf_model_path, or tokenizer_path's directory), or pretokenized `input_ids` +
    # `labels` (transformers' convention, -100 not counted). The loss is the mean over
    # the counted tokens of the whole step, all microbatches together.
    use_sft: bool = key(
        False,
        "supervised fine-tuning on conversations (messages) or input_ids/labels rows of "
        "hf_train_files (docs/finetune.md)",
    )
    sft_train_on_completion_only: bool = key(
        True, "use_sft: count only the assistant's tokens / labels not -100 (false: every token)"
    )
    # TRL's SFTConfig.packing (its default is false; the trainer packs by default).
    packing: bool = key(True, "use_sft: several examples per row (false: one example a row)")


@dataclasses.dataclass(frozen=True)
class EvaluationConfig:
    """The held-out loss: how often, over what."""

    # Evaluation (eval_data.py, evaluate.py), under MaxText's names: a held-out loss
    # every eval_interval steps and at the end (<= 0: never), over the first eval_steps
    # batches of the eval set (<= 0: all of it, text and hf only) of
    # eval_per_device_batch_size sequences per device (0: per_device_batch_size). Text
    # runs read eval_dataset_path (MaxText names it per data type: grain_eval_files,
    # hf_eval_files), hf runs hf_eval_files; synthetic runs get a held-out stream drawn
    # from the same seed.
    eval_interval: int = key(-1, "held-out loss every this many steps and at the end (<= 0: never)")
    eval_steps: int = key(-1, "eval batches per evaluation (<= 0: the whole eval set)")
    eval_per_device_batch_size: float = key(0.0, "eval sequences per device (0: training's)")
    eval_dataset_path: str = key("", "text: the eval files (directory or glob)")
    # mtp_eval_target_module=k > 0: evaluation reports depth k's top-1 acceptance.
    mtp_eval_target_module: int = key(0, "report MTP depth k's top-1 acceptance (0: off)")


@dataclasses.dataclass(frozen=True)
class CheckpointingConfig:
    """Saving and restoring the training state, and starting from other weights."""

    # Checkpoints (checkpoint.py): on when base_output_directory is set; they go to
    # run_dir/checkpoints, every checkpoint_period steps (0: only at the end) and at
    # the end, async; a restart resumes from the newest complete one.
    enable_checkpointing: bool = key(True, "save checkpoints (when base_output_directory is set)")
    async_checkpointing: bool = key(True, "save in the background while training goes on")
    checkpoint_period: int = key(100, "save every this many steps (0: only at the end)")
    max_checkpoints_to_keep: int = key(3, "newest checkpoints kept")
    # Initial parameters (and routing biases) only, from another run's checkpoint:
    # its checkpoints directory (the newest step) or one step's directory (MaxText's key).
    load_parameters_path: str = key("", "initial parameters from another run's checkpoint")


@dataclasses.dataclass(frozen=True)
class OutputConfig:
    """Where a run writes, and what it logs, measures and profiles."""

    run_name: str = key("", "run directory name ('': model_name)")
    base_output_directory: str = key("", "parent of the run directory ('': outputs)")
    log_period: int = key(
        1,
        "print a step line every this many steps (and the last); metrics.jsonl and "
        "TensorBoard still get every step",
    )
    device_peak_tflops: float = key(0.0, "peak TFLOP/s per device for MFU (0: from the device)")
    # Metrics (metrics.py): JSONL and TensorBoard event files under run_dir.
    enable_tensorboard: bool = key(True, "also write TensorBoard event files")
    # Profiling (profiling.py): jax.profiler traces under run_dir/tensorboard.
    profiler: Literal["", "xplane"] = key("", "xplane: jax.profiler traces ('': off)")
    profiler_start_step: int = key(2, "first profiled step")
    profiler_steps: int = key(3, "profiled steps")
