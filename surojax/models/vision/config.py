"""`VisionConfig`: the vision tower's shape, read from a checkpoint's `vision_config` as transformers 5.17 reads it.

Qwen3-VL (`qwen3_vl`, `qwen3_vl_moe`) and Qwen3.5 (`qwen3_5`, `qwen3_5_moe`) share the tower; Qwen3.5 has no
deepstack mergers (`Qwen3_5VisionModel` deletes them), so a non-empty `deepstack_visual_indexes` there is refused.
Absent keys take transformers' defaults (Qwen3VLVisionConfig); a key this module does not know is refused, except
PreTrainedConfig's bookkeeping keys, which do not change the computation.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

# PreTrainedConfig's own keys (names, labels, generation / output flags): present in every saved config, none
# changes what the tower computes.
_BOOKKEEPING = frozenset({
    "_name_or_path", "architectures", "chunk_size_feed_forward", "dtype", "torch_dtype", "id2label", "label2id",
    "is_encoder_decoder", "output_attentions", "output_hidden_states", "problem_type", "return_dict",
    "transformers_version", "model_type", "initializer_range", "tie_word_embeddings", "pruned_heads",
    "tf_legacy_loss", "use_bfloat16", "add_cross_attention", "is_decoder", "finetuning_task", "tokenizer_class",
    "prefix", "bos_token_id", "eos_token_id", "pad_token_id", "sep_token_id", "decoder_start_token_id",
    "task_specific_params", "torchscript", "cross_attention_hidden_size", "_attn_implementation_autoset",
})
_DEEPSTACK_FAMILIES = ("qwen3_vl", "qwen3_vl_moe")
_FAMILIES = _DEEPSTACK_FAMILIES + ("qwen3_5", "qwen3_5_moe")
ACTIVATIONS = ("gelu_pytorch_tanh", "gelu", "silu", "quick_gelu")


class VisionConfigError(ValueError):
    """A vision_config the tower cannot honour; the message names the key and the source."""


@dataclass(frozen=True)
class VisionConfig:
    depth: int = 27
    hidden_size: int = 1152
    hidden_act: str = "gelu_pytorch_tanh"
    intermediate_size: int = 4304
    num_heads: int = 16
    in_channels: int = 3
    patch_size: int = 16
    spatial_merge_size: int = 2
    temporal_patch_size: int = 2
    out_hidden_size: int = 3584
    num_position_embeddings: int = 2304
    deepstack_visual_indexes: tuple[int, ...] = (8, 16, 24)
    rope_theta: float = 10000.0
    layer_norm_eps: float = 1e-6  # fixed in transformers (nn.LayerNorm(..., eps=1e-6)), not a config key

    def __post_init__(self):
        if self.hidden_size % self.num_heads or (self.hidden_size // self.num_heads) % 4:
            raise VisionConfigError(f"vision_config: hidden_size {self.hidden_size} / num_heads {self.num_heads} "
                                    "must be a head dim divisible by 4 (the 2-D rotary splits it in quarters)")
        side = int(self.num_position_embeddings ** 0.5)
        if side * side != self.num_position_embeddings:
            raise VisionConfigError(f"vision_config: num_position_embeddings {self.num_position_embeddings} is "
                                    "not a square (the learned positions are a side x side grid)")
        bad = [i for i in self.deepstack_visual_indexes if not 0 <= i < self.depth]
        if bad:
            raise VisionConfigError(f"vision_config: deepstack_visual_indexes {bad} outside the {self.depth} blocks")
        if self.hidden_act not in ACTIVATIONS:
            raise VisionConfigError(f"vision_config: hidden_act {self.hidden_act!r} is not one of {ACTIVATIONS}")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def patch_dim(self) -> int:
        """Length of one row of pixel_values: channels x temporal_patch_size x patch_size x patch_size."""
        return self.in_channels * self.temporal_patch_size * self.patch_size * self.patch_size

    @property
    def position_grid_side(self) -> int:
        return int(self.num_position_embeddings ** 0.5)

    @classmethod
    def from_hf(cls, vision_config: Mapping, family: str, source: str = "config.json") -> "VisionConfig":
        """From the `vision_config` dict of a `family` (the outer config's model_type) checkpoint."""
        if family not in _FAMILIES:
            raise VisionConfigError(f"{source}: model_type {family!r} has no vision tower here (known: {_FAMILIES})")
        read = {"depth", "hidden_size", "hidden_act", "intermediate_size", "num_heads", "in_channels",
                "patch_size", "spatial_merge_size", "temporal_patch_size", "out_hidden_size",
                "num_position_embeddings", "deepstack_visual_indexes", "rope_parameters"}
        unknown = sorted(set(vision_config) - read - _BOOKKEEPING)
        if unknown:
            raise VisionConfigError(f"{source}: vision_config keys {unknown} are not understood (read: {sorted(read)})")
        kwargs = {k: vision_config[k] for k in read - {"deepstack_visual_indexes", "rope_parameters"}
                  if k in vision_config}
        for key in ("patch_size", "temporal_patch_size"):
            if isinstance(kwargs.get(key), (list, tuple)):
                values = set(kwargs[key])
                if len(values) != 1:
                    raise VisionConfigError(f"{source}: vision_config.{key} {kwargs[key]} is not square")
                kwargs[key] = values.pop()
        deepstack = vision_config.get("deepstack_visual_indexes")
        if family in _DEEPSTACK_FAMILIES:
            if deepstack is not None:
                kwargs["deepstack_visual_indexes"] = tuple(int(i) for i in deepstack)
        else:
            if deepstack:
                raise VisionConfigError(f"{source}: vision_config.deepstack_visual_indexes {deepstack} given for "
                                        f"{family}, whose tower has no deepstack mergers")
            kwargs["deepstack_visual_indexes"] = ()
        rope = dict(vision_config.get("rope_parameters") or {})
        if rope.get("rope_type", "axial") != "axial" or set(rope) - {"rope_type", "rope_theta"}:
            raise VisionConfigError(f"{source}: vision_config.rope_parameters {rope} — only the axial rope "
                                    "(rope_type 'axial', rope_theta) is defined for this tower")
        if "rope_theta" in rope:
            kwargs["rope_theta"] = float(rope["rope_theta"])
        return cls(**kwargs)
