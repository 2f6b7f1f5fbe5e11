"""Which Hugging Face tensor fills which trainer parameter, and how.

The trainer keeps the layers of each stack ("dense_layers", "moe_layers") on a
leading axis and the routed experts on the next one; a HF file keeps one tensor
per layer (and per expert) under `model.layers.{i}.…`. A torch Linear weight is
[out, in]; the trainer's kernels are [in..., out...], so a linear weight is the
transpose, its dims then split (e.g. q_b_proj [H*K, Q] -> wq_b_QxHxK).
RoPE needs no reordering: the model rotates interleaved pairs (rope_interleave),
the layout DeepSeek's files keep.
"""

from __future__ import annotations

import dataclasses
import math
import re

import numpy as np

STACK_FIRST_LAYER = {"dense_layers": 0, "moe_layers": None}  # None: first_num_dense_layers

# (sub-path inside a block, is the block MoE) -> (HF suffix, leading dims forming `in`;
# None: stored as is). `{e}` is the expert index.
LAYER_KEYS: dict[tuple[tuple[str, ...], bool | None], tuple[str, int | None]] = {
    (("attn_norm", "scale"), None): ("input_layernorm.weight", None),
    (("ffn_norm", "scale"), None): ("post_attention_layernorm.weight", None),
    (("attn", "wq_a_DxQ"), None): ("self_attn.q_a_proj.weight", 1),
    (("attn", "q_norm", "scale"), None): ("self_attn.q_a_layernorm.weight", None),
    (("attn", "wq_b_QxHxK"), None): ("self_attn.q_b_proj.weight", 1),
    (("attn", "wq_DxHxK"), None): ("self_attn.q_proj.weight", 1),
    (("attn", "wkv_a_DxCR"), None): ("self_attn.kv_a_proj_with_mqa.weight", 1),
    (("attn", "kv_norm", "scale"), None): ("self_attn.kv_a_layernorm.weight", None),
    (("attn", "wkv_b_CxHxNV"), None): ("self_attn.kv_b_proj.weight", 1),
    (("attn", "wo_HxVxD"), None): ("self_attn.o_proj.weight", 2),
    (("ffn", "wi_0"), False): ("mlp.gate_proj.weight", 1),
    (("ffn", "wi_1"), False): ("mlp.up_proj.weight", 1),
    (("ffn", "wo"), False): ("mlp.down_proj.weight", 1),
    (("ffn", "gate"), True): ("mlp.gate.weight", 1),
    (("ffn", "bias"), True): ("mlp.gate.e_score_correction_bias", None),
    (("ffn", "wi_0"), True): ("mlp.experts.{e}.gate_proj.weight", 1),
    (("ffn", "wi_1"), True): ("mlp.experts.{e}.up_proj.weight", 1),
    (("ffn", "wo"), True): ("mlp.experts.{e}.down_proj.weight", 1),
    (("ffn", "shared_wi_0"), True): ("mlp.shared_experts.gate_proj.weight", 1),
    (("ffn", "shared_wi_1"), True): ("mlp.shared_experts.up_proj.weight", 1),
    (("ffn", "shared_wo"), True): ("mlp.shared_experts.down_proj.weight", 1),
}
GLOBAL_KEYS: dict[tuple[str, ...], tuple[str, int | None]] = {
    ("embedding_VxD",): ("model.embed_tokens.weight", None),
    ("final_norm", "scale"): ("model.norm.weight", None),
    ("logits_DxV",): ("lm_head.weight", 1),
}
# Multi-token prediction (trainer/model/mtp.py, under `mtp/`, stacked over depth):
# depth k is HF layer num_hidden_layers + k - 1. Its block uses LAYER_KEYS.
MTP_KEYS: dict[tuple[str, ...], tuple[str, int | None]] = {
    ("enorm", "scale"): ("enorm.weight", None),
    ("hnorm", "scale"): ("hnorm.weight", None),
    # [d, 2d] = [embedding half | hidden half] -> (2, d_in, d_out).
    ("eh_proj_2xDxD",): ("eh_proj.weight", 2),
    ("head_norm", "scale"): ("shared_head.norm.weight", None),
}
# DeepSeek-V3's MTP layers also hold copies of the main embedding and head (the
# trainer shares the main ones): skipped on import, written on export.
MTP_SHARED_COPIES = {
    ("embedding_VxD",): ("embed_tokens.weight", None),
    ("logits_DxV",): ("shared_head.head.weight", 1),
}
SCALE_SUFFIX = "_scale_inv"
# Tensors some checkpoints hold that no parameter reads: Kimi-K2's per-layer RoPE
# frequencies (computed from config.json; transformers ignores them too).
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
LAYER_INDEX = re.compile(r"^model\.layers\.(\d+)\.")
# deepseek_v2 has no routing bias tensor: the trainer's stays zero.
OPTIONAL_IN_V2 = "mlp.gate.e_score_correction_bias"


@dataclasses.dataclass(frozen=True)
class Leaf:
    """One trainer parameter and the HF tensors it is made of.

    `tree`/`path` locate it ("params" or "router", then the dict keys); `shape` is
    the trainer's full shape, whose first `len(lead)` dims are (layer[, expert]);
    `template` is the HF name with `{i}` (layer) and `{e}` (expert); `in_dims`
    how many per-tensor dims form a linear weight's input (None: stored as is).
    """

    tree: str
    path: tuple[str, ...]
    shape: tuple[int, ...]
    template: str
    in_dims: int | None
    first_layer: int = 0
    stacked: bool = False
    per_expert: bool = False
    optional: bool = False  # absent from the files of this family (zeros)

    @property
    def lead(self) -> int:
        return int(self.stacked) + int(self.per_expert)

    @property
    def tensor_shape(self) -> tuple[int, ...]:
        """The trainer-side shape of one HF tensor's worth (lead dims dropped)."""
        return self.shape[self.lead :]

    @property
    def hf_shape(self) -> tuple[int, ...]:
        """The shape of each HF tensor of this leaf."""
        per = self.tensor_shape
        if self.in_dims is None:
            return per
        return (math.prod(per[self.in_dims :]), math.prod(per[: self.in_dims]))

    def names(self) -> list[tuple[tuple[int, ...], str]]:
        """(lead index, HF name) of every HF tensor of the leaf, in file order."""
        layers = range(self.shape[0]) if self.stacked else [None]
        out = []
        for layer in layers:
            experts = range(self.shape[1]) if self.per_expert else [None]
            for expert in experts:
                lead = tuple(i for i in (layer, expert) if i is not None)
                i = None if layer is None else layer + self.first_layer
                out.append((lead, self.template.format(i=i, e=expert)))
        return out

    def to_trainer(self, hf_tensor: np.ndarray) -> np.ndarray:
        """A view of one HF tensor in the trainer's per-tensor layout (no copy)."""
        if self.in_dims is None:
            return hf_tensor
        return hf_tensor.T.reshape(self.tensor_shape)

    def to_hf(self, trainer_tensor: np.ndarray) -> np.ndarray:
        """The inverse of `to_trainer`."""
        if self.in_dims is None:
            return trainer_tensor
        per = self.tensor_shape
        flat = trainer_tensor.reshape(math.prod(per[: self.in_dims]), -1)
        return flat.T


def _flat(tree: dict, prefix: tuple = ()) -> list[tuple[tuple[str, ...], object]]:
    out = []
    for key, value in tree.items():
        if isinstance(value, dict):
            out += _flat(value, prefix + (key,))
        else:
            out.append((prefix + (key,), value))
    return out


def _layer_leaf(tree, path, sub, shape, moe, first_layer, model_type) -> Leaf:
    key = (sub, moe) if (sub, moe) in LAYER_KEYS else (sub, None)
    if key not in LAYER_KEYS:
        raise ValueError(f"trainer parameter {'/'.join(path)} has no HF name")
    suffix, in_dims = LAYER_KEYS[key]
    return Leaf(
        tree,
        path,
        shape,
        "model.layers.{i}." + suffix,
        in_dims,
        first_layer=first_layer,
        stacked=True,
        per_expert="{e}" in suffix,
        optional=suffix == OPTIONAL_IN_V2 and model_type == "deepseek_v2",
    )


def leaves(trees: dict[str, dict], config, model_type: str) -> list[Leaf]:
    """A Leaf for every array of `trees` ({"params": ..., "router": ...}, arrays or
    ShapeDtypeStructs) of a model with `config`'s layer counts; ValueError naming a
    trainer parameter with no HF name."""
    first_dense, num_layers = config.first_num_dense_layers, config.base_num_decoder_layers
    # An MTP block is dense or MoE as the main model's later layers.
    mtp_moe = config.base_num_decoder_layers > config.first_num_dense_layers
    out = []
    for tree, root in trees.items():
        for path, value in _flat(root):
            shape = tuple(value.shape)
            if path[0] in STACK_FIRST_LAYER:
                moe = path[0] == "moe_layers"
                first = first_dense if moe else 0
                out.append(_layer_leaf(tree, path, path[1:], shape, moe, first, model_type))
            elif path[0] == "mtp" and path[1] == "block":
                out.append(
                    _layer_leaf(tree, path, path[2:], shape, mtp_moe, num_layers, model_type)
                )
            elif path[0] == "mtp" and path[1:] in MTP_KEYS:
                suffix, in_dims = MTP_KEYS[path[1:]]
                template = "model.layers.{i}." + suffix
                out.append(Leaf(tree, path, shape, template, in_dims, num_layers, stacked=True))
            elif path in GLOBAL_KEYS:
                out.append(Leaf(tree, path, shape, *GLOBAL_KEYS[path]))
            else:
                raise ValueError(f"trainer parameter {'/'.join(path)} has no HF name")
    return out


def mtp_depths(found: list[Leaf]) -> int:
    """How many MTP depths the leaves hold (0: MTP off)."""
    return next((leaf.shape[0] for leaf in found if leaf.path[0] == "mtp"), 0)


def mtp_copies(found: list[Leaf], num_layers: int) -> list[Leaf]:
    """Leaves that write the main embedding and head again into every MTP layer, as
    DeepSeek-V3's files hold them (export only)."""
    out = []
    for depth in range(mtp_depths(found)):
        for leaf in found:
            if leaf.path in MTP_SHARED_COPIES:
                suffix, in_dims = MTP_SHARED_COPIES[leaf.path]
                name = f"model.layers.{num_layers + depth}.{suffix}"
                out.append(dataclasses.replace(leaf, template=name, in_dims=in_dims))
    return out


def layer_index(name: str) -> int | None:
    """The decoder layer a HF tensor belongs to (None outside `model.layers`)."""
    match = LAYER_INDEX.match(name)
    return int(match.group(1)) if match else None


def is_fp8_weight_of(name: str, leaf: Leaf) -> bool:
    """Whether DeepSeek's fp8 files may quantize this tensor: layer linear weights
    but the router's (embedding, head, norms and router stay in bf16/f32)."""
    return leaf.in_dims is not None and leaf.stacked and ".mlp.gate." not in name
