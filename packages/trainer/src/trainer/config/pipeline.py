"""Pipeline parallelism's keys checked against the rest of the config (before compiling).

The stages are the 'stage' mesh axis (ici_pipeline_parallelism x
dcn_pipeline_parallelism, `mesh_shape`); the MoE layers split over them
(model/pipeline.py), in stages x repeats chunks of equal slots, padded where they do
not divide the layers (`layer_slots`). Inside the stages compose: data, dcn_data,
ZeRO-1, fsdp and dcn_fsdp (weights gathered once per step), expert (expert
parallelism; with expert_shard_attention_option=context it splits attention's
sequence too), tensor (attention's heads split, the MoE block whole over it) and
context (the sequence split, keys and values gathered). tensor_transpose splits the
embed dim, which the stages do not sum by hand, and is refused. What does not
compose is refused here in one line naming the key and its value.
"""

from __future__ import annotations

from trainer.config.config import Config
from trainer.config.keys import STAGE_AXIS, ConfigError
from trainer.config.run_keys import AccumulationConfig, ParallelismConfig

# Mesh axes that split a layer's compute in a way the stages do not write by hand:
# the embed dim (every norm and projection would sum over it). The stages run their
# layers per device in one manual shard_map (model/pipeline.py). fsdp and dcn_fsdp
# compose (each stage's weights gathered once per step before the loop), as do
# expert (the MoE layers' own all-to-all, moe_kernels.ManualExperts), tensor
# (attention's head split, psummed by ShardCtx.einsum in manual mode) and context
# (keys and values gathered along the sequence by ShardCtx.relayout).
LAYER_AXES = ("tensor_transpose",)
# Reduction policies that reduce inside the loop by design (per microbatch, or
# in-slice reduce-scatters per microbatch): inside the pipeline loop that would
# be once per iteration.
IN_LOOP_POLICIES = ("per_microbatch", "hierarchical")
SCHEDULES = ("plain", "fused")  # fused runs as plain: the stages scan their own layers


def pipeline_microbatches(parallelism: ParallelismConfig, accumulation: AccumulationConfig) -> int:
    """Microbatches through the pipeline per step: num_pipeline_microbatches, or
    (-1) the accumulation's, gradient_accumulation_steps."""
    m = parallelism.num_pipeline_microbatches
    return accumulation.gradient_accumulation_steps if m == -1 else m


def bubble_fraction(stages: int, microbatches: int, repeats: int = 1) -> float:
    """Share of stage-iterations idle: (p-1) / (m x repeats + p-1) (GPipe: repeats 1)."""
    return (stages - 1) / (microbatches * repeats + stages - 1)


def stage_count(config: Config) -> int:
    """The 'stage' axis' size the config asks for (ici x dcn pipeline parallelism)."""
    return config.ici_pipeline_parallelism * config.dcn_pipeline_parallelism


def slots_per_chunk(layers: int, stages: int, repeats: int = 1) -> int:
    """Layer slots in each of the stages x repeats chunks: ceil(layers / chunks)."""
    return -(-layers // (stages * repeats))


def padded_layers(layers: int, stages: int, repeats: int = 1) -> int:
    """Slots of the pipeline's stack: stages x repeats chunks of `slots_per_chunk`."""
    return stages * repeats * slots_per_chunk(layers, stages, repeats)


def layer_slots(layers: int, stages: int, repeats: int = 1) -> tuple[int, ...]:
    """The slot of each MoE layer in the pipeline's padded stack of stages x repeats
    chunks of `slots_per_chunk` slots (chunk j runs on stage j mod stages as its repeat
    j // stages, model/pipeline.py). Uneven stages: the stack has chunks x c - layers
    padding slots, one at the end of each of the last chunks, so the real layers stay
    in the model's order, consecutive within a chunk, and chunks differ by at most one
    real layer. Without padding (or stages 1) slot i is layer i."""
    chunks = stages * repeats
    c = slots_per_chunk(layers, stages, repeats)
    full = chunks - (chunks * c - layers)  # the first chunks: c real layers each
    out = []
    for j in range(chunks):
        real = c if j < full else c - 1
        out.extend(j * c + i for i in range(real))
    return tuple(out)


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)


def check_pipeline(config: Config, sizes: dict[str, int]) -> None:
    """ConfigError naming the key for a pipeline setting that cannot run (mesh `sizes`)."""
    p, r = sizes.get(STAGE_AXIS, 1), config.num_pipeline_repeats
    m = pipeline_microbatches(config.parallelism, config.accumulation)
    ga = config.gradient_accumulation_steps
    stage_keys = (
        f"ici_pipeline_parallelism={config.ici_pipeline_parallelism} x "
        f"dcn_pipeline_parallelism={config.dcn_pipeline_parallelism}"
    )
    _require(r >= 1, f"num_pipeline_repeats={r} must be >= 1 (1: GPipe)")
    _require(
        m >= 1, f"num_pipeline_microbatches={config.num_pipeline_microbatches} must be >= 1 or -1"
    )
    if p == 1:
        return
    layers = config.num_moe_layers
    # Uneven stages are padded (layer_slots); a chunk without any real layer is not.
    _require(
        layers >= p * r,
        f"{stage_keys} = {p} stages x num_pipeline_repeats={r}: the {layers} MoE layers "
        f"(base_num_decoder_layers={config.base_num_decoder_layers} - first_num_dense_layers="
        f"{config.first_num_dense_layers}) are fewer than the {p * r} chunks: some chunk "
        "would hold no layer",
    )
    _require(
        m >= p,
        f"num_pipeline_microbatches={m} is fewer than the {p} stages ({stage_keys}): "
        "some stage would never work",
    )
    _require(
        ga == 1 or m == ga,
        f"num_pipeline_microbatches={m} must equal gradient_accumulation_steps={ga}: "
        "the pipeline's microbatches are the accumulation's (or leave it -1)",
    )
    for axis in LAYER_AXES:
        key = f"ici_{axis}_parallelism"
        _require(
            sizes.get(axis, 1) == 1,
            f"{key}={sizes.get(axis, 1)} with {p} pipeline stages is not supported: it "
            "splits a layer's compute, which the stages' per-device layers would do by "
            "hand (data, fsdp, tensor, context, expert and ZeRO-1 compose)",
        )
    schedule = config.gradient_accumulation_schedule
    _require(
        schedule in SCHEDULES,
        f"gradient_accumulation_schedule={schedule} with {p} pipeline stages: the pipeline "
        "loop is the accumulation loop; use plain or fused (which runs as plain)",
    )
    policy = config.gradient_reduction_policy
    _require(
        policy not in IN_LOOP_POLICIES,
        f"gradient_reduction_policy={policy} with {p} pipeline stages would reduce inside "
        "the pipeline loop; use deferred or auto",
    )
    _require(
        not config.lora_rank,
        f"lora_rank={config.lora_rank} with {p} pipeline stages is not supported",
    )
