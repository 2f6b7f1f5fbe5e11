"""What a checkpoint holds and how a restart is compared with it: the keys that must
match (MODEL_KEYS), the ones that may change (TRAJECTORY_KEYS), the state never saved,
and the errors a save or restore ends in."""

from __future__ import annotations

from trainer.config import FIELDS

SUBDIR = "checkpoints"
# A checkpoint written with any other value of these cannot be restored into this run.
MODEL_KEYS = (
    "vocab_size",
    "base_emb_dim",
    "base_num_decoder_layers",
    "first_num_dense_layers",
    "base_mlp_dim",
    "base_moe_mlp_dim",
    "num_experts",
    "shared_experts",
    "base_num_query_heads",
    "q_lora_rank",
    "kv_lora_rank",
    "qk_nope_head_dim",
    "qk_rope_head_dim",
    "v_head_dim",
    # The rope dims' pair layout: the same arrays mean another model under the other one.
    "rope_interleave",
    "weight_dtype",
    # The adapters' shapes (LoRA): a checkpoint of another rank or set holds other arrays.
    "lora_rank",
    "lora_targets",
)
# Keys a checkpoint written before they existed did not save: their value then was this.
KEY_DEFAULTS = {
    key: FIELDS[key].default for key in ("lora_rank", "lora_targets", "mu_dtype", "nu_dtype")
}
# State entries never saved: a LoRA run's frozen base, loaded again at every start
# (from hf_model_path, load_parameters_path or the seed), like the initial weights.
NOT_SAVED = ("frozen",)
# These change the data stream or the schedule: a resume with other values is
# allowed (extending `steps`, say) but no longer continues the same run.
TRAJECTORY_KEYS = (
    "seed",
    "steps",
    "learning_rate",
    "per_device_batch_size",
    "gradient_accumulation_steps",
    "max_target_length",
    "dataset_type",
    "dataset_path",
    "jsonl_field",
    "tokenizer_path",
    "hf_train_files",
    "train_data_columns",
    "use_sft",
    "sft_train_on_completion_only",
    "lora_alpha",
    # The moments are cast on restore (checkpoint_dtypes.py): the run goes on, rounded.
    "mu_dtype",
    "nu_dtype",
)


class CheckpointError(Exception):
    """A checkpoint could not be saved or restored; the message is one line for the user."""


class CheckpointSaveError(CheckpointError):
    pass


class CheckpointRestoreError(CheckpointError):
    pass
