"""ModelConfig: the architecture of a dense decoder, read from and written to a Hugging Face config.json.

Shape legend, used in docstrings, einsum strings, weight names and `# [B, T, D]` comments everywhere:

    B  batch (rows)                  T  query positions          S  key/value positions
    D  embed (hidden size)           N  query heads              K  key/value heads
    H  head dim                      F  MLP hidden (intermediate) E  experts
    V  vocabulary                    L  layers (the stacked, scanned axis)
    G  query heads per kv head (N // K)                          R  LoRA rank

Only architecture lives here: remat, scan, sharding, dtype policy and LoRA are training settings and stay
out of this object (they are applied to a built model from outside).
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any

import numpy as np

from surojax.models.registry import family_for


class ModelConfigError(ValueError):
    """A config.json that surojax cannot turn into a ModelConfig."""

    is_user_error = True


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """Rotary-embedding frequency scaling. `rope_type` is 'default', 'linear', 'llama3', 'yarn' or 'proportional'.

    proportional (Gemma 4's full-attention layers, transformers' `_compute_proportional_rope_parameters`): the first
    int(partial_rotary_factor * H // 2) frequencies base ** (-2i / H) over the whole head_dim H, the rest zero (those
    dims pass unrotated: cos 1, sin 0), all divided by factor.

    linear: factor. llama3: factor, low/high_freq_factor, original_max_position_embeddings. yarn (transformers'
    `_compute_yarn_parameters`): factor, original_max_position_embeddings, beta_fast / beta_slow (the ramp's
    rotation bounds), truncate (round the ramp's ends to integers), and the cos/sin scale: attention_factor when
    given, else from mscale / mscale_all_dim when both are given, else 0.1 ln(factor) + 1.
    """

    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    truncate: bool = True
    attention_factor: float | None = None
    mscale: float | None = None
    mscale_all_dim: float | None = None
    partial_rotary_factor: float = 1.0  # proportional: the rotated share of the head's frequencies

    def hf_fields(self) -> dict[str, Any]:
        """The `rope_parameters` keys transformers reads for this rope_type (rope_theta aside)."""
        keys = {"default": (), "linear": ("factor",),
                "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
                "yarn": ("factor", "original_max_position_embeddings", "beta_fast", "beta_slow", "truncate",
                         "attention_factor", "mscale", "mscale_all_dim"),
                "proportional": ("factor", "partial_rotary_factor")}[self.rope_type]
        out = {"rope_type": self.rope_type} | {k: getattr(self, k) for k in keys if getattr(self, k) is not None}
        if self.rope_type == "proportional" and self.factor == 1.0:  # as transformers writes it: factor optional
            out.pop("factor")
        return out

    @classmethod
    def from_hf(cls, rs: dict[str, Any], hf: dict[str, Any]) -> "RopeScaling":
        """`rs` the config's rope_scaling / rope_parameters dict ({} when absent), `hf` the whole config.json.

        As transformers' `standardize_rope_params`: a top-level `original_max_position_embeddings` wins over the
        dict's; llama3 / yarn without one use max_position_embeddings; yarn's factor None is their ratio."""
        rope_type = rs.get("rope_type", rs.get("type", "default"))
        if rope_type not in ("default", "linear", "llama3", "yarn", "proportional"):
            raise ModelConfigError(
                f"rope_scaling type {rope_type!r} is not supported (default, linear, llama3, yarn, proportional)")
        original = hf.get("original_max_position_embeddings", rs.get("original_max_position_embeddings"))
        if original is None:
            original = hf.get("max_position_embeddings", 4096) if rope_type in ("llama3", "yarn") else 8192
        factor = rs.get("factor", 1.0)
        if factor is None and rope_type == "yarn":
            factor = hf.get("max_position_embeddings", 4096) / original

        def opt(key):
            return None if rs.get(key) is None else float(rs[key])

        return cls(rope_type=rope_type, factor=float(factor),
                   low_freq_factor=float(rs.get("low_freq_factor", 1.0)),
                   high_freq_factor=float(rs.get("high_freq_factor", 4.0)),
                   original_max_position_embeddings=int(original),
                   beta_fast=float(rs.get("beta_fast") or 32.0), beta_slow=float(rs.get("beta_slow") or 1.0),
                   truncate=bool(rs.get("truncate", True)), attention_factor=opt("attention_factor"),
                   mscale=opt("mscale"), mscale_all_dim=opt("mscale_all_dim"),
                   partial_rotary_factor=float(rs.get("partial_rotary_factor", 1.0))
                   if rope_type == "proportional" else 1.0)


@dataclasses.dataclass(frozen=True)
class LinearAttentionConfig:
    """The Gated DeltaNet layers of a hybrid model (Qwen3.5; models/layers/gated_deltanet.py).

    layers: per HF layer, True for a Gated DeltaNet layer (`linear_attention` in config.json's `layer_types`),
    False for a full-attention one. Hk / Hv key / value heads (Hv a multiple of Hk: each key head serves Hv / Hk
    value heads), Dk / Dv their dims, a depthwise causal conv of `conv_kernel` taps over the q | k | v channels.
    """

    layers: tuple[bool, ...]
    num_key_heads: int  # Hk
    num_value_heads: int  # Hv
    key_head_dim: int  # Dk
    value_head_dim: int  # Dv
    conv_kernel: int

    def __post_init__(self):
        if self.num_value_heads % self.num_key_heads:
            raise ModelConfigError(f"linear_num_value_heads ({self.num_value_heads}) must be a multiple of "
                                   f"linear_num_key_heads ({self.num_key_heads})")
        if min(self.num_key_heads, self.key_head_dim, self.value_head_dim, self.conv_kernel) < 1:
            raise ModelConfigError(f"the linear attention's heads, head dims and conv kernel must be positive: {self}")

    @property
    def key_dim(self) -> int:  # Hk * Dk
        return self.num_key_heads * self.key_head_dim

    @property
    def value_dim(self) -> int:  # Hv * Dv
        return self.num_value_heads * self.value_head_dim

    @property
    def conv_dim(self) -> int:  # the channels of the conv: q | k | v
        return 2 * self.key_dim + self.value_dim

    def layer_params(self, hidden: int) -> int:
        """One DeltaNet mixer: in_proj_qkv, in_proj_z, in_proj_b / a, conv, dt_bias, A_log, gated norm, out_proj."""
        Hv = self.num_value_heads
        return (hidden * (self.conv_dim + self.value_dim + 2 * Hv) + self.conv_dim * self.conv_kernel + 2 * Hv
                + self.value_head_dim + self.value_dim * hidden)


# the dense MLP's activations: silu / swish (SwiGLU), gelu_pytorch_tanh (Gemma's GeGLU, tanh-approximated GELU)
HIDDEN_ACTS = ("silu", "swish", "gelu_pytorch_tanh")


@dataclasses.dataclass(frozen=True)
class ShortConvConfig:
    """The short-convolution layers of LFM2 (models/layers/short_conv.py).

    layers: per HF layer, True for a short-convolution layer (`conv` in config.json's `layer_types`), False for a
    full-attention one. kernel: the conv's taps (`conv_L_cache`); bias: `conv_bias` (in_proj, the conv and out_proj
    carry biases)."""

    layers: tuple[bool, ...]
    kernel: int
    bias: bool = False

    def __post_init__(self):
        if self.kernel < 2:
            raise ModelConfigError(f"conv_L_cache {self.kernel} must be >= 2 (a causal conv of that many taps)")

    def layer_params(self, hidden: int) -> int:
        """One short conv: in_proj [D, 3D], the depthwise kernel [D, K], out_proj [D, D] (+ their biases)."""
        return 4 * hidden * hidden + hidden * self.kernel + (5 * hidden if self.bias else 0)


ROUTERS = ("softmax_topk", "topk_softmax", "sigmoid_topk")
EXPERT_ACTIVATIONS = ("swiglu", "swiglu_clamped", "geglu")


@dataclasses.dataclass(frozen=True)
class MoEConfig:
    """The sparse feed-forward of a mixture-of-experts family (every layer of the stack is sparse; lfm2_moe's dense
    leading layers are stacks of their own, Gemma 4's MoE block runs beside the dense MLP).

    router          "softmax_topk": softmax over the E logits, then the k largest probabilities (qwen3_moe,
                    mixtral, gemma4); "topk_softmax": the k largest logits, then a softmax over those k (gpt_oss);
                    "sigmoid_topk" (lfm2_moe): sigmoid of each logit, the k largest scores (+ `selection_bias`)
    norm_topk_prob  renormalise the k weights of "softmax_topk" / "sigmoid_topk" to sum to 1 (mixtral always
                    does): w / (sum w + norm_topk_eps)
    selection_bias  a per-expert bias [E] added to the scores for choosing the k experts only; the weights stay
                    the unbiased scores (lfm2_moe's `use_expert_bias`, its `expert_bias` buffer)
    routed_scaling_factor
                    the k weights times this after any renormalisation (lfm2_moe)
    router_input_norm
                    Gemma 4's router reads RMSNorm(x) without a weight (this eps) times a learned scale [D] and
                    D^-0.5; None: the router reads x
    per_expert_scale
                    Gemma 4: each chosen weight times its expert's learned scale [E] (after the renormalisation)
    activation      "swiglu": silu(gate) * up with gate | up the two halves of the fused gate_up projection;
                    "geglu" (gemma4): gelu_pytorch_tanh(gate) * up, same layout;
                    "swiglu_clamped" (gpt_oss): gate/up interleaved, clamped to `swiglu_limit`,
                    (up + 1) * gate * sigmoid(swiglu_alpha * gate)
    shared_expert_intermediate_size
                    F_s > 0: a shared expert beside the routed ones, a SwiGLU MLP of width F_s that every token runs,
                    scaled by a sigmoid gate (Linear(D, 1)): y = routed(x) + sigmoid(x @ g) * shared(x) (qwen2_moe,
                    qwen3_5_moe); 0: none. It is not routed: the router, its stats and losses do not see it.
    """

    num_experts: int  # E
    experts_per_token: int  # k
    expert_intermediate_size: int  # F of one expert
    norm_topk_prob: bool = False
    router: str = "softmax_topk"
    router_bias: bool = False
    expert_bias: bool = False
    activation: str = "swiglu"
    swiglu_limit: float = 7.0
    swiglu_alpha: float = 1.702
    router_aux_loss_coef: float = 0.0  # the HF config's coefficient of the load-balancing loss
    shared_expert_intermediate_size: int = 0  # F_s of the shared expert; 0: no shared expert
    selection_bias: bool = False
    norm_topk_eps: float = 0.0
    routed_scaling_factor: float = 1.0
    router_input_norm: float | None = None  # eps of Gemma 4's router input norm
    per_expert_scale: bool = False

    def __post_init__(self):
        if not 0 < self.experts_per_token <= self.num_experts:
            raise ModelConfigError(f"num_experts_per_tok ({self.experts_per_token}) must be in 1..num_experts "
                                   f"({self.num_experts})")
        if self.expert_intermediate_size <= 0:
            raise ModelConfigError(f"the experts' intermediate size must be positive, got "
                                   f"{self.expert_intermediate_size}")
        if self.router not in ROUTERS:
            raise ModelConfigError(f"router {self.router!r} is not one of {', '.join(ROUTERS)}")
        if self.shared_expert_intermediate_size < 0:
            raise ModelConfigError(f"shared_expert_intermediate_size must be >= 0 (0: no shared expert), got "
                                   f"{self.shared_expert_intermediate_size}")
        if self.activation not in EXPERT_ACTIVATIONS:
            raise ModelConfigError(f"expert activation {self.activation!r} is not one of "
                                   f"{', '.join(EXPERT_ACTIVATIONS)}")

    def expert_params(self, hidden: int) -> int:
        """Parameters of one expert: gate and up [D, F], down [F, D] (+ biases)."""
        F = self.expert_intermediate_size
        return 3 * hidden * F + ((2 * F + hidden) if self.expert_bias else 0)

    def router_params(self, hidden: int) -> int:
        """The router's parameters (lfm2_moe's selection bias left out: transformers holds it as a buffer)."""
        E = self.num_experts
        return (hidden * E + (E if self.router_bias else 0) + (hidden if self.router_input_norm is not None else 0)
                + (E if self.per_expert_scale else 0))

    def shared_expert_params(self, hidden: int) -> int:
        """The shared expert (gate and up [D, F_s], down [F_s, D]) and its gate [D, 1]; 0 without one."""
        F = self.shared_expert_intermediate_size
        return 3 * hidden * F + hidden if F else 0


@dataclasses.dataclass(frozen=True)
class GlobalAttention:
    """Gemma 4's full-attention ("global") layers when shaped unlike the sliding ones, as transformers'
    Gemma4TextAttention builds them from `per_layer_config` (or `global_head_dim` / `num_global_key_value_heads`):
    their own head size and kv heads, and with `attention_k_eq_v` no v_proj (the values are the key projection's
    output, v-normed; the keys k-normed and rotated). The decoder holds them in a stack of their own,
    `global_layers` (decoder.layer_pattern), built from `ModelConfig.global_config()`."""

    head_dim: int
    num_kv_heads: int
    k_eq_v: bool = False


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    model_type: str
    vocab_size: int  # V
    hidden_size: int  # D
    intermediate_size: int  # F
    num_layers: int  # L
    num_heads: int  # N
    num_kv_heads: int  # K
    head_dim: int  # H
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling = dataclasses.field(default_factory=RopeScaling)
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # q/k/v projections carry a bias (qwen2)
    qk_norm: bool = False  # RMSNorm over H on q and k before rope (qwen3)
    sliding_window: int | None = None  # each token sees at most this many keys, itself included (mistral)
    # Per-layer windows [L] from HF `layer_types` (an entry: `sliding_window` or None = full attention); None:
    # every layer uses `sliding_window`. gpt_oss alternates sliding / full.
    layer_windows: tuple[int | None, ...] | None = None
    attention_sinks: bool = False  # a learned logit per query head [N] joins each softmax denominator (gpt_oss)
    o_proj_bias: bool = False  # o_proj carries a bias too (gpt_oss: attention_bias covers q, k, v and o)
    hidden_act: str = "silu"
    bos_token_id: int | None = None
    eos_token_id: int | tuple[int, ...] | None = None
    pad_token_id: int | None = None
    # a mixture-of-experts feed-forward in every layer (None: the dense SwiGLU MLP), but `dense_layers` / beside it
    moe: MoEConfig | None = None
    # Gemma 4's MoE block (`enable_moe_block`): the MoE runs beside the dense MLP in every layer instead of replacing
    # it (decoder.Block: each branch post-normed, the sum post-normed again)
    moe_beside_mlp: bool = False
    # lfm2_moe's `num_dense_layers`: its first n layers have the dense SwiGLU MLP (intermediate_size) instead of the
    # MoE; they live in stacks of their own (registry.DENSE_STACKS) and share their kind's cache part
    dense_layers: int = 0
    # Hybrid (Qwen3.5): the Gated DeltaNet layers (None: every layer is an attention layer)
    linear_attention: LinearAttentionConfig | None = None
    attn_output_gate: bool = False  # q_proj also gives a per-head sigmoid gate on the attention output (Qwen3.5)
    norm_zero_centered: bool = False  # RMSNorms scale by (1 + w), w initialised to zeros (Qwen3.5)
    partial_rotary_factor: float = 1.0  # rope on the first head_dim * factor dims of each head, the rest passes
    # Gemma 3 (`gemma3_text`, `gemma3`): post-attention and post-feed-forward norms on each sublayer's output before
    # the residual add (the "sandwich"), embeddings times sqrt(D) (in the embedding's dtype), the query scale
    # query_pre_attn_scalar ** -0.5 (None: head_dim ** -0.5), and the sliding-window layers' own rope (None: every
    # layer uses rope_theta / rope_scaling; else a layer with a window uses local_rope_theta / local_rope_scaling).
    sandwich_norms: bool = False
    scale_embeddings: bool = False
    query_pre_attn_scalar: float | None = None
    local_rope_theta: float | None = None
    local_rope_scaling: RopeScaling = dataclasses.field(default_factory=RopeScaling)
    # Gemma 4 (`gemma4_text`, `gemma4`): the values RMS-normalised without a scale (v_norm), and each layer's output
    # multiplied by its own scalar (`layer_scalar`, a buffer transformers saves with the checkpoint)
    v_norm: bool = False
    layer_scalar: bool = False
    final_logit_softcapping: float | None = None  # c: logits -> c * tanh(logits / c) (Decoder.logits, the losses)
    # Gemma 4: the full-attention layers' own shape (None: as the sliding layers'); they then live in `global_layers`
    global_attention: GlobalAttention | None = None
    # the values are the key projection's output (no v_proj): set on the config the global stack is built from (and
    # on a Gemma 4 config whose every layer is a full-attention one with attention_k_eq_v)
    attention_k_eq_v: bool = False
    # Gemma 4's per-layer input embeddings (PLE, `hidden_size_per_layer_input` P > 0): a table [V_p, L P] and a
    # projection of the embeddings give every layer its input [B, T, P], gated into the layer's output
    per_layer_input_size: int = 0
    per_layer_vocab_size: int = 0
    # Gemma 4's KV-shared layers (`num_kv_shared_layers`): the last n layers compute no keys / values, they attend
    # over those of the last earlier layer of their type (`kv_source`); `use_double_wide_mlp` widens their MLP x 2
    kv_shared_layers: int = 0
    double_wide_mlp: bool = False
    kv_shared: bool = False  # set on the config a KV-shared stack is built from: no k / v projections
    # LFM2: the short-convolution layers (None: every layer is an attention layer or a DeltaNet one)
    short_conv: ShortConvConfig | None = None
    # Multimodal rope (Qwen3-VL, Qwen3.5: `rope_parameters.mrope_section`, interleaved): the rotary frequencies
    # given to the temporal / height / width positions when the decoder is handed rope_positions [3, B, T]
    # (models/vision/mrope.py); None: 1-D rope only. With 1-D positions every section rotates by the same position.
    mrope_section: tuple[int, int, int] | None = None
    # The HF config.json this came from, kept so that to_hf() can write back what surojax does not model.
    hf_extra: dict[str, Any] = dataclasses.field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self):
        if self.num_heads % self.num_kv_heads:
            raise ModelConfigError(
                f"num_attention_heads ({self.num_heads}) must be a multiple of num_key_value_heads ({self.num_kv_heads})")
        g = self.global_attention
        if g is not None and (self.num_heads % g.num_kv_heads or g.head_dim <= 0):
            raise ModelConfigError(f"the full-attention layers' num_key_value_heads ({g.num_kv_heads}) must divide "
                                   f"num_attention_heads ({self.num_heads}); head_dim {g.head_dim} positive")
        if g is not None and all(self.layer_window(i) is None for i in range(self.num_layers)):
            raise ModelConfigError("global_attention needs sliding layers beside the full ones (a model of full "
                                   "layers only takes their shape as its own)")
        if self.kv_shared_layers:
            if not 0 < self.kv_shared_layers < self.num_layers:
                raise ModelConfigError(f"num_kv_shared_layers {self.kv_shared_layers} must leave at least one layer "
                                       f"of the {self.num_layers} computing its own keys / values")
            for i in range(self.num_layers - self.kv_shared_layers, self.num_layers):
                if self.kv_source(i) is None:
                    raise ModelConfigError(f"KV-shared layer {i} ({self.layer_kind(i)}) has no earlier layer of its "
                                           f"type before layer {self.num_layers - self.kv_shared_layers} to share")
        if self.layer_windows is not None and (
                len(self.layer_windows) != self.num_layers
                or any(w is not None and w != self.sliding_window for w in self.layer_windows)):
            raise ModelConfigError(f"layer_windows {self.layer_windows} must have num_layers ({self.num_layers}) "
                                   f"entries, each None or sliding_window ({self.sliding_window})")
        if not 0 < self.rotary_dim <= self.head_dim or self.rotary_dim % 2:
            raise ModelConfigError(f"partial_rotary_factor {self.partial_rotary_factor} gives a rotary dim of "
                                   f"{self.rotary_dim} for head_dim {self.head_dim} (must be even, 2..head_dim)")
        if self.linear_attention is not None and len(self.linear_attention.layers) != self.num_layers:
            raise ModelConfigError(f"layer_types has {len(self.linear_attention.layers)} entries, num_hidden_layers "
                                   f"is {self.num_layers}")
        if self.short_conv is not None and len(self.short_conv.layers) != self.num_layers:
            raise ModelConfigError(f"layer_types has {len(self.short_conv.layers)} entries, num_hidden_layers is "
                                   f"{self.num_layers}")
        if self.short_conv is not None and self.linear_attention is not None:
            raise ModelConfigError("a model has either Gated DeltaNet or short-convolution layers, not both")
        if not 0 <= self.dense_layers <= self.num_layers or (self.dense_layers and self.moe is None):
            raise ModelConfigError(f"num_dense_layers {self.dense_layers} must be in 0..num_hidden_layers "
                                   f"({self.num_layers}), on a MoE model")
        if self.hidden_act not in HIDDEN_ACTS:
            raise ModelConfigError(f"hidden_act {self.hidden_act!r} is not supported (expected one of "
                                   f"{', '.join(HIDDEN_ACTS)})")
        if self.hidden_act not in ("silu", "swish") and ((self.moe is not None and not self.moe_beside_mlp)
                                                         or self.linear_attention is not None):
            raise ModelConfigError(f"hidden_act {self.hidden_act!r} is not supported with MoE or hybrid layers "
                                   "(their MLPs are SwiGLU)")

    @property
    def q_dim(self) -> int:  # N * H
        return self.num_heads * self.head_dim

    @property
    def kv_dim(self) -> int:  # K * H
        return self.num_kv_heads * self.head_dim

    @property
    def rotary_dim(self) -> int:
        """The leading dims of each head that rope rotates (head_dim unless partial_rotary_factor < 1)."""
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def num_attention_layers(self) -> int:
        """The layers with attention (and a KV cache): all of them but a hybrid's linear-attention layers."""
        kinds = self.linear_attention or self.short_conv
        return self.num_layers if kinds is None else self.num_layers - sum(kinds.layers)

    def layer_window(self, layer: int) -> int | None:
        """The attention window of layer `layer` (None: full causal attention)."""
        return self.sliding_window if self.layer_windows is None else self.layer_windows[layer]

    def layer_is_global(self, layer: int) -> bool:
        """Layer `layer` is a full-attention layer of its own shape (`global_attention`: the `global_layers` stack)."""
        return self.global_attention is not None and self.layer_window(layer) is None

    def layer_kind(self, layer: int) -> str:
        """"full_attention" or "sliding_attention" (HF `layer_types`' names)."""
        return "full_attention" if self.layer_window(layer) is None else "sliding_attention"

    def layer_is_kv_shared(self, layer: int) -> bool:
        """Layer `layer` is one of the last `kv_shared_layers` (it reads another layer's keys / values)."""
        return layer >= self.num_layers - self.kv_shared_layers > 0 and self.kv_shared_layers > 0

    def kv_source(self, layer: int) -> int | None:
        """The layer whose keys / values KV-shared layer `layer` reads: the last layer of its kind before the
        shared ones (transformers' `store_full_length_kv`); None when there is none."""
        first = self.num_layers - self.kv_shared_layers
        return next((i for i in range(first - 1, -1, -1) if self.layer_kind(i) == self.layer_kind(layer)), None)

    def layer_stack(self, layer: int) -> str:
        """The stack holding layer `layer` of an attention-only model: `layers`, Gemma 4's `global_layers` (full
        layers of their own shape), `shared_layers` / `shared_global_layers` (its KV-shared layers)."""
        glob = self.layer_is_global(layer)
        if self.layer_is_kv_shared(layer):
            return "shared_global_layers" if glob else "shared_layers"
        return "global_layers" if glob else "layers"

    def stack_config(self, stack: str) -> "ModelConfig":
        """The config the blocks of `stack` (`layer_stack`'s names) are built from."""
        cfg = self.global_config() if "global" in stack else self
        if stack.startswith("shared"):
            wide = self.intermediate_size * (2 if self.double_wide_mlp else 1)
            cfg = cfg.replace(kv_shared=True, intermediate_size=wide)
        return cfg

    def global_config(self) -> "ModelConfig":
        """The config the full-attention layers of their own shape are built from (`global_attention`'s head size,
        kv heads and k = v); this config when they have none."""
        g = self.global_attention
        if g is None:
            return self
        return self.replace(head_dim=g.head_dim, num_kv_heads=g.num_kv_heads, attention_k_eq_v=g.k_eq_v,
                            global_attention=None)

    def layer_rope(self, layer: int) -> int:
        """Which rope layer `layer` uses: 0 the config's (rope_theta / rope_scaling), 1 the sliding layers' own
        (Gemma 3: a layer with a window, when local_rope_theta is set)."""
        return int(self.local_rope_theta is not None and self.layer_window(layer) is not None)

    def rope_configs(self) -> tuple["ModelConfig", ...]:
        """The configs whose rope_theta / rope_scaling give each rope `layer_rope` names (index 0, 1): this config
        alone, or with a local rope also this config with the local rope as its own."""
        if self.local_rope_theta is None:
            return (self,)
        # the full layers' rope spans their own head size (Gemma 4's global_head_dim: transformers' rope of the
        # full_attention layer type reads per_layer_config["full_attention"].head_dim)
        full = self.global_config() if self.global_attention is not None else self
        return (full, self.replace(rope_theta=self.local_rope_theta, rope_scaling=self.local_rope_scaling,
                                   local_rope_theta=None))

    def num_params(self) -> int:
        """Parameters of the model, embeddings included (tied embeddings counted once)."""
        D, V = self.hidden_size, self.vocab_size
        mixers = 0
        if self.linear_attention is None and self.short_conv is None:  # attention-only: each layer's stack's shape
            for i in range(self.num_layers):
                c = self.stack_config(self.layer_stack(i))
                mixers += c._attention_params() + (3 * D * (c.intermediate_size - self.intermediate_size)
                                                   if c.kv_shared else 0)  # the double-wide MLP's extra width
        else:
            mixers = self.num_attention_layers * self._attention_params()
        P = self.per_layer_input_size
        if P:  # the PLE table, its projection and norm; per layer its gate, projection and norm
            mixers += self.per_layer_vocab_size * self.num_layers * P + D * self.num_layers * P + P \
                + self.num_layers * (2 * D * P + D)
        if self.linear_attention is not None:
            mixers += (self.num_layers - self.num_attention_layers) * self.linear_attention.layer_params(D)
        if self.short_conv is not None:
            mixers += (self.num_layers - self.num_attention_layers) * self.short_conv.layer_params(D)
        norms = 2 * D * (2 if self.sandwich_norms else 1)  # attn / mlp norms (+ their post norms)
        sparse, dense = self.num_layers - self.dense_layers, self.dense_layers  # lfm2_moe's dense leading layers
        return mixers + sparse * self._ffn_params(active=False) + dense * 3 * D * self.intermediate_size \
            + self.num_layers * norms + V * D * (1 if self.tie_word_embeddings else 2) + D

    def _attention_params(self) -> int:
        """One attention layer of this config's shape."""
        D = self.hidden_size
        kv_projections = 0 if self.kv_shared else 1 if self.attention_k_eq_v else 2
        attn = D * self.q_dim * (2 if self.attn_output_gate else 1) + kv_projections * D * self.kv_dim \
            + self.q_dim * D
        if self.attention_bias:
            attn += self.q_dim + kv_projections * self.kv_dim
        if self.qk_norm:
            attn += (1 if self.kv_shared else 2) * self.head_dim
        return attn + D * self.o_proj_bias + self.num_heads * self.attention_sinks

    def num_active_params(self) -> int:
        """Parameters one token runs through: a MoE layer counts its router and k experts, not all E."""
        if self.moe is None:
            return self.num_params()
        sparse = self.num_layers - self.dense_layers
        return self.num_params() - sparse * (self._ffn_params(active=False) - self._ffn_params(active=True))

    def _ffn_params(self, *, active: bool) -> int:
        D = self.hidden_size
        dense = 3 * D * self.intermediate_size
        if self.moe is None:
            return dense
        n = self.moe.experts_per_token if active else self.moe.num_experts
        sparse = self.moe.router_params(D) + n * self.moe.expert_params(D) + self.moe.shared_expert_params(D)
        return sparse + (dense + 3 * D if self.moe_beside_mlp else 0)  # Gemma 4: + the MLP and the block's 3 norms

    def replace(self, **changes) -> "ModelConfig":
        return dataclasses.replace(self, **changes)

    # ---- Hugging Face config.json --------------------------------------------------------------------------
    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> "ModelConfig":
        """Build from a parsed config.json. The family's registry entry supplies the family flags. A multimodal
        family's config.json (`text_config`) gives the text model's keys; the whole file stays in hf_extra."""
        family = family_for(hf.get("model_type"))
        outer = hf
        if family.text_config:
            if not isinstance(hf.get("text_config"), dict):
                raise ModelConfigError(f"model_type {family.name!r}: config.json needs a `text_config` object (the "
                                       "language model's keys)")
            hf = {**hf["text_config"], **{k: outer[k] for k in ("tie_word_embeddings",) if k in outer}}
        if family.short_conv:  # Lfm2MoeConfig reads `tie_embedding` too, not `block_ff_dim`
            hf = lfm2_aliases(hf) if family.moe is None else lfm2_aliases({k: v for k, v in hf.items()
                                                                           if k != "block_ff_dim"})
        required = ["vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads"]
        if family.intermediate_size_key:
            required.insert(2, "intermediate_size")
        elif "intermediate_size" in hf:
            raise ModelConfigError(f"model_type {hf.get('model_type')!r}: intermediate_size {hf['intermediate_size']} "
                                   "is not read (every layer's MLP is the sparse MoE: moe_intermediate_size and "
                                   "shared_expert_intermediate_size give its widths); remove it from config.json")
        missing = [k for k in required if k not in hf]
        if missing:
            raise ModelConfigError(f"config.json lacks {', '.join(missing)} (model_type {hf.get('model_type')!r})")
        n_heads = int(hf["num_attention_heads"])
        gemma = Gemma3Text.from_hf(hf) if family.gemma3 else Gemma4Text.from_hf(hf) if family.gemma4 else None
        if gemma is not None:
            hf = gemma.hf  # Gemma 4 of full layers only: their head_dim / kv heads are the model's
        head_dim = hf.get("head_dim") or hf["hidden_size"] // n_heads
        if gemma is not None:
            rs, rope_theta, scaling = {}, gemma.rope_theta, gemma.rope_scaling
        else:
            rs = hf.get("rope_scaling") or hf.get("rope_parameters") or {}
            theta = family.rope_theta_default
            rope_theta = hf.get("rope_theta", rs.get("rope_theta", theta) if rs else theta)
            scaling = RopeScaling.from_hf(rs, hf)
        if hf.get("mlp_bias"):
            raise ModelConfigError("mlp_bias: true is not supported (no supported family has MLP biases)")
        if hf.get("attention_bias") and not family.attention_bias:
            raise ModelConfigError(f"attention_bias: true is not supported for {family.name} "
                                   "(it would add an o_proj bias; only qwen2-style q/k/v biases are modelled)")
        sliding = hf.get("sliding_window") if family.sliding_window else None
        if family.sliding_window and hf.get("use_sliding_window") is False:
            sliding = None
        layer_windows = None
        linear_attention = linear_attention_from_hf(hf) if family.hybrid else None
        partial = float(rs.get("partial_rotary_factor", hf.get("partial_rotary_factor",
                                                                 family.partial_rotary_default)))
        if partial != 1.0 and not family.hybrid:
            raise ModelConfigError("partial_rotary_factor != 1 is not supported (rope over the whole head_dim)")
        if partial != 1.0 and "proportional" in (scaling.rope_type, gemma and gemma.local_rope_scaling.rope_type):
            raise ModelConfigError("rope_type 'proportional' with partial_rotary_factor != 1 at the config's top level "
                                   "is not supported (the proportional rope spans the whole head_dim)")
        mrope = _mrope_section(rs, family.mrope) if family.mrope else None
        short_conv = short_conv_from_hf(hf) if family.short_conv else None
        if hf.get("layer_types") is not None and not (family.hybrid or family.short_conv):
            if family.sliding_window and not (family.gemma3 or family.gemma4):
                raise ModelConfigError(f"layer_types is not read by transformers' {family.hf_architecture} "
                                       "(one sliding_window for every layer); remove it from config.json")
            sliding, layer_windows = _windows_from_layer_types(hf)
        attention_bias = bool(hf.get(family.bias_key, family.attention_bias))
        return cls(
            model_type=family.name,
            vocab_size=int(hf["vocab_size"]),
            hidden_size=int(hf["hidden_size"]),
            intermediate_size=(lfm2_ff_dim(hf) if family.short_conv and family.moe is None
                               else int(hf["intermediate_size"]))
            if family.intermediate_size_key else 0,
            num_layers=int(hf["num_hidden_layers"]),
            num_heads=n_heads,
            num_kv_heads=int(hf.get("num_key_value_heads") or n_heads),
            head_dim=int(head_dim),
            rms_norm_eps=float(hf.get(family.norm_eps_key, 1e-6)),
            rope_theta=float(rope_theta),
            rope_scaling=scaling,
            max_position_embeddings=int(hf.get("max_position_embeddings", 4096)),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", family.tie_default)),
            attention_bias=attention_bias,
            qk_norm=family.qk_norm,
            sliding_window=int(sliding) if sliding else None,
            layer_windows=layer_windows,
            attention_sinks=family.attention_sinks,
            o_proj_bias=attention_bias and family.o_proj_bias,
            hidden_act=hf.get("hidden_act", "silu"),
            bos_token_id=hf.get("bos_token_id"),
            eos_token_id=tuple(hf["eos_token_id"]) if isinstance(hf.get("eos_token_id"), list) else hf.get("eos_token_id"),
            pad_token_id=hf.get("pad_token_id"),
            moe=moe_from_hf(family.moe, hf) if gemma is None else getattr(gemma, "moe", None),
            dense_layers=int(hf.get("num_dense_layers", 2)) if family.moe == "lfm2_moe" else 0,
            linear_attention=linear_attention,
            attn_output_gate=family.hybrid,
            norm_zero_centered=family.hybrid or family.gemma3,
            partial_rotary_factor=partial,
            short_conv=short_conv,
            mrope_section=mrope,
            hf_extra=dict(outer),
            **({} if gemma is None else gemma.fields()),
        )

    def to_hf(self) -> dict[str, Any]:
        """A config.json dict that `transformers.AutoConfig` reads back into the same architecture."""
        # quantization_config: a saved model holds plain float weights (an MXFP4 checkpoint is dequantised on load)
        dropped = ("architectures", "model_type", "rope_scaling", "rope_parameters", "torch_dtype", "dtype",
                   "quantization_config")
        out = {k: v for k, v in self.hf_extra.items() if k not in dropped}

        family = family_for(self.model_type)
        if family.text_config:  # the text model's keys under text_config; the rest (vision_config, ...) as read
            text = self.replace(model_type=self.model_type + "_text",
                                hf_extra=dict(self.hf_extra.get("text_config") or {})).to_hf()
            text.pop("architectures")
            return out | {"architectures": [family.hf_architecture], "model_type": self.model_type,
                          "text_config": text, "tie_word_embeddings": self.tie_word_embeddings}
        out.update(
            architectures=[family.hf_architecture],
            model_type=self.model_type,
            vocab_size=self.vocab_size,
            hidden_size=self.hidden_size,
            num_hidden_layers=self.num_layers,
            num_attention_heads=self.num_heads,
            num_key_value_heads=self.num_kv_heads,
            head_dim=self.head_dim,
            rms_norm_eps=self.rms_norm_eps,
            rope_theta=self.rope_theta,
            max_position_embeddings=self.max_position_embeddings,
            tie_word_embeddings=self.tie_word_embeddings,
            hidden_act=self.hidden_act,
        )
        if family.intermediate_size_key:
            out["intermediate_size"] = self.intermediate_size
        if family.short_conv:  # the older aliases would override what is written (transformers pops them last)
            out = {k: v for k, v in out.items() if k not in ("block_ff_dim", "tie_embedding")}
            out.update(short_conv_to_hf(self))
        if family.gemma3 or family.gemma4:  # per-layer-type ropes, hidden_activation: the generic keys differ
            for k in ("rope_theta", "hidden_act", "rope_local_base_freq", "sliding_window_pattern"):
                out.pop(k, None)
            out.update((Gemma3Text if family.gemma3 else Gemma4Text).to_hf(self))
        else:
            # transformers >= 5 reads `rope_parameters`; older versions read rope_theta / rope_scaling.
            rs = self.rope_scaling.hf_fields()
            if self.rope_scaling.rope_type != "default":
                out["rope_scaling"] = rs | {"type": rs["rope_type"]}
            out["rope_parameters"] = rs | {"rope_theta": self.rope_theta}
        if self.mrope_section is not None:
            out["rope_parameters"] |= {"mrope_section": list(self.mrope_section), "mrope_interleaved": True}
        if family.hybrid:
            out["rope_parameters"]["partial_rotary_factor"] = out["partial_rotary_factor"] = \
                self.partial_rotary_factor
            out.update(linear_attention_to_hf(self.linear_attention))
        if family.attention_bias_key:
            out[family.bias_key] = self.attention_bias
        if family.sliding_window:
            out["sliding_window"] = self.sliding_window
        if self.layer_windows is not None or family.gemma3 or family.gemma4 or ("layer_types" in self.hf_extra
                                                               and not (family.hybrid or family.short_conv)):
            out["sliding_window"] = self.sliding_window
            out["layer_types"] = ["full_attention" if self.layer_window(i) is None else "sliding_attention"
                                  for i in range(self.num_layers)]
        for k in ("bos_token_id", "eos_token_id", "pad_token_id"):
            if getattr(self, k) is not None:
                out[k] = getattr(self, k)
        if self.moe is not None and not family.gemma4:  # Gemma 4 writes its MoE block's keys itself
            out.update(moe_to_hf(family.moe, self.moe))
        return out


@dataclasses.dataclass(frozen=True)
class Gemma3Text:
    """Gemma 3's text keys (transformers' Gemma3TextConfig), read into the ModelConfig fields they set.

    hf: the text config with `layer_types` filled in (as transformers builds it without the key: every
    `sliding_window_pattern`-th layer full attention, the others sliding; default 6) and `hidden_act` the
    `hidden_activation`. Ropes: transformers 5's `rope_parameters` per layer type ({"full_attention": {...},
    "sliding_attention": {...}}), or the legacy keys `rope_theta` (+ `rope_scaling`) for the full-attention layers
    and `rope_local_base_freq` for the sliding ones (defaults 1e6 and 1e4). Refused by name: logit soft-capping
    (`final_logit_softcapping`, `attn_logit_softcapping`: tanh capping is not implemented), bidirectional
    attention, a sliding layer without a positive `sliding_window`."""

    hf: dict[str, Any]
    rope_theta: float
    rope_scaling: RopeScaling
    local_rope_theta: float
    local_rope_scaling: RopeScaling
    query_pre_attn_scalar: float

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> "Gemma3Text":
        for key in ("final_logit_softcapping", "attn_logit_softcapping"):
            if hf.get(key) is not None:
                raise ModelConfigError(f"gemma3: {key} {hf[key]} is not supported (tanh soft-capping of the "
                                       f"{'logits' if key.startswith('final') else 'attention scores'} is not "
                                       "implemented; Gemma 3 checkpoints set it null)")
        if hf.get("use_bidirectional_attention"):
            raise ModelConfigError("gemma3: use_bidirectional_attention true is not supported (the decoder is causal)")
        act = hf.get("hidden_activation", "gelu_pytorch_tanh")
        if hf.get("hidden_act") not in (None, act):
            raise ModelConfigError(f"gemma3: hidden_act {hf['hidden_act']!r} differs from hidden_activation {act!r} "
                                   "(transformers' Gemma 3 reads hidden_activation)")
        L = int(hf["num_hidden_layers"])
        types = hf.get("layer_types")
        if types is None:
            period = int(hf.get("sliding_window_pattern", hf.get("_sliding_window_pattern", 6)))
            types = ["sliding_attention" if (i + 1) % period else "full_attention" for i in range(L)]
        if "sliding_attention" in types and not hf.get("sliding_window"):
            raise ModelConfigError(f"gemma3: sliding_window {hf.get('sliding_window')!r}: the sliding_attention "
                                   "layers of layer_types need a positive window")
        rp = hf.get("rope_parameters") or {}
        if rp and not set(rp) <= {"full_attention", "sliding_attention"}:
            raise ModelConfigError(f"gemma3: rope_parameters {rp} must be per layer type (keys full_attention, "
                                   "sliding_attention), as transformers 5 writes it")
        full = dict(rp.get("full_attention") or {**(hf.get("rope_scaling") or {}),
                                                  "rope_theta": hf.get("rope_theta", 1_000_000.0)})
        local = dict(rp.get("sliding_attention") or {"rope_type": "default",
                                                     "rope_theta": hf.get("rope_local_base_freq", 10_000.0)})
        full.setdefault("rope_theta", 1_000_000.0)
        local.setdefault("rope_theta", 10_000.0)
        return cls(hf={**hf, "layer_types": list(types), "hidden_act": act},
                   rope_theta=float(full["rope_theta"]), rope_scaling=RopeScaling.from_hf(full, hf),
                   local_rope_theta=float(local["rope_theta"]), local_rope_scaling=RopeScaling.from_hf(local, hf),
                   query_pre_attn_scalar=float(hf.get("query_pre_attn_scalar", 256)))

    def fields(self) -> dict[str, Any]:
        """The ModelConfig fields Gemma 3 sets (beside the generic ones read from `hf`)."""
        return dict(sandwich_norms=True, scale_embeddings=True, query_pre_attn_scalar=self.query_pre_attn_scalar,
                    local_rope_theta=self.local_rope_theta, local_rope_scaling=self.local_rope_scaling)

    @staticmethod
    def to_hf(cfg: "ModelConfig") -> dict[str, Any]:
        """The Gemma 3 keys of cfg's config.json (transformers 5's spelling); layer_types / sliding_window are the
        generic per-layer window keys."""
        def rope(theta, scaling):
            return scaling.hf_fields() | {"rope_theta": theta}

        qpas = cfg.query_pre_attn_scalar
        return {"hidden_activation": cfg.hidden_act,
                "query_pre_attn_scalar": int(qpas) if float(qpas).is_integer() else qpas,
                "rope_parameters": {"full_attention": rope(cfg.rope_theta, cfg.rope_scaling),
                                    "sliding_attention": rope(cfg.local_rope_theta, cfg.local_rope_scaling)},
                "final_logit_softcapping": None, "attn_logit_softcapping": None}


@dataclasses.dataclass(frozen=True)
class Gemma4Text:
    """Gemma 4's text keys (transformers' Gemma4TextConfig), read into the ModelConfig fields they set: the dense
    text model (Gemma 3's block with plain-w norms, an unscaled v norm, softmax scale 1, a scalar per layer).

    hf: the text config with `layer_types` filled in as transformers builds it (without the key every 6th layer
    full attention; the last layer is forced to full attention, as transformers does) and `hidden_act` the
    `hidden_activation`. Ropes: `rope_parameters` per layer type (default: sliding layers rope_theta 1e4, full layers
    `proportional` with partial_rotary_factor 0.25, rope_theta 1e6).

    Full-attention layers shaped unlike the sliding ones (`per_layer_config`, or `global_head_dim` /
    `num_global_key_value_heads`; `attention_k_eq_v`: no v_proj on them) are read into `global_attention`
    (`_gemma4_global_attention`): their own stack `global_layers`.

    Per-layer input embeddings (`hidden_size_per_layer_input` P, default 256; `vocab_size_per_layer_input`) and
    KV-shared layers (`num_kv_shared_layers`, with `use_double_wide_mlp` widening only their MLPs) are read into
    ModelConfig's per_layer_input_size / per_layer_vocab_size / kv_shared_layers / double_wide_mlp.

    Refused by name, each with the reason (never silently mis-read): bidirectional attention, a `query_pre_attn_scalar` (transformers' Gemma 4 does not read one: its scale is 1).
    `final_logit_softcapping` (c > 0 or null) is read: logits c * tanh(logits / c). The MoE block
    (`enable_moe_block`: `num_experts`, `top_k_experts`, `moe_intermediate_size`) is read into `moe`: beside the
    dense MLP in every layer (ModelConfig.moe_beside_mlp), a softmax top-k router renormalised and times a
    per-expert scale, reading RMSNorm(x) * scale * D^-0.5, GeGLU experts."""

    hf: dict[str, Any]
    rope_theta: float
    rope_scaling: RopeScaling
    local_rope_theta: float
    local_rope_scaling: RopeScaling
    final_logit_softcapping: float | None
    moe: MoEConfig | None = None
    global_attention: GlobalAttention | None = None
    k_eq_v_everywhere: bool = False  # every layer is a full one, with attention_k_eq_v
    # per_layer_input_size / per_layer_vocab_size (PLE), kv_shared_layers, double_wide_mlp: ModelConfig's fields
    sharing: dict[str, Any] = dataclasses.field(default_factory=dict)

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> "Gemma4Text":
        keys = {"per_layer_input_size": ("hidden_size_per_layer_input", 256),  # transformers' default: PLE on
                "per_layer_vocab_size": ("vocab_size_per_layer_input", 262_144),
                "kv_shared_layers": ("num_kv_shared_layers", 0)}
        ple = {}
        for field, (key, default) in keys.items():
            value = ple[field] = hf.get(key, default)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ModelConfigError(f"gemma4: {key} {value!r} must be a non-negative integer")
        ple["double_wide_mlp"] = bool(hf.get("use_double_wide_mlp", False))
        cap = hf.get("final_logit_softcapping")
        if cap is not None and not float(cap) > 0:
            raise ModelConfigError(f"gemma4: final_logit_softcapping {cap!r} must be a positive number or null")
        if hf.get("use_bidirectional_attention"):
            raise ModelConfigError(f"gemma4: use_bidirectional_attention {hf['use_bidirectional_attention']!r} is "
                                   "not supported (the decoder is causal)")
        if hf.get("query_pre_attn_scalar") is not None:
            raise ModelConfigError("gemma4: query_pre_attn_scalar is not read by transformers' Gemma 4 (its softmax "
                                   "scale is 1, the q norm sets the size); remove it from config.json")
        act = hf.get("hidden_activation", "gelu_pytorch_tanh")
        if hf.get("hidden_act") not in (None, act):
            raise ModelConfigError(f"gemma4: hidden_act {hf['hidden_act']!r} differs from hidden_activation {act!r} "
                                   "(transformers' Gemma 4 reads hidden_activation)")
        L = int(hf["num_hidden_layers"])
        types = list(hf.get("layer_types") or ["sliding_attention" if (i + 1) % 6 else "full_attention"
                                               for i in range(L)])
        if len(types) != L or not set(types) <= {"sliding_attention", "full_attention"}:
            raise ModelConfigError(f"gemma4: layer_types {types} must give sliding_attention / full_attention for "
                                   f"each of the {L} layers")
        types[-1] = "full_attention"  # as transformers: the last layer is always full attention
        if "sliding_attention" in types and not hf.get("sliding_window", 512):
            raise ModelConfigError(f"gemma4: sliding_window {hf.get('sliding_window')!r}: the sliding_attention "
                                   "layers of layer_types need a positive window")
        glob = _gemma4_global_attention(hf, types)
        same = (glob.head_dim, glob.num_kv_heads, glob.k_eq_v) == (*_gemma4_shape(hf), False)
        fold = {}
        if "sliding_attention" not in types:  # every layer full: their shape is the model's own
            fold = {"head_dim": glob.head_dim, "num_key_value_heads": glob.num_kv_heads}
        rp = hf.get("rope_parameters") or {"sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
                                           "full_attention": {"rope_type": "proportional", "rope_theta": 1_000_000.0,
                                                              "partial_rotary_factor": 0.25}}
        if not set(rp) <= {"full_attention", "sliding_attention"}:
            raise ModelConfigError(f"gemma4: rope_parameters {rp} must be per layer type (keys full_attention, "
                                   "sliding_attention)")
        full, local = dict(rp.get("full_attention") or {}), dict(rp.get("sliding_attention") or {})
        for name, r in (("full_attention", full), ("sliding_attention", local)):
            if "rope_theta" not in r:
                raise ModelConfigError(f"gemma4: rope_parameters.{name} lacks rope_theta")
        return cls(hf={**hf, "layer_types": types, "hidden_act": act, "sliding_window": hf.get("sliding_window", 512),
                       **fold},
                   global_attention=None if same or fold else glob, k_eq_v_everywhere=bool(fold) and glob.k_eq_v,
                   sharing=ple,
                   rope_theta=float(full["rope_theta"]), rope_scaling=RopeScaling.from_hf(full, hf),
                   local_rope_theta=float(local["rope_theta"]), local_rope_scaling=RopeScaling.from_hf(local, hf),
                   final_logit_softcapping=None if cap is None else float(cap), moe=_gemma4_moe(hf, act))

    def fields(self) -> dict[str, Any]:
        """The ModelConfig fields Gemma 4 sets (beside the generic ones read from `hf`)."""
        return dict(sandwich_norms=True, scale_embeddings=True, query_pre_attn_scalar=1.0, v_norm=True,
                    layer_scalar=True, moe_beside_mlp=self.moe is not None, local_rope_theta=self.local_rope_theta,
                    local_rope_scaling=self.local_rope_scaling, final_logit_softcapping=self.final_logit_softcapping,
                    global_attention=self.global_attention, attention_k_eq_v=self.k_eq_v_everywhere, **self.sharing)

    @staticmethod
    def to_hf(cfg: "ModelConfig") -> dict[str, Any]:
        """The Gemma 4 keys of cfg's config.json (transformers 5's spelling), the unbuilt features written off;
        layer_types / sliding_window are the generic per-layer window keys."""
        def rope(theta, scaling):
            return scaling.hf_fields() | {"rope_theta": theta}

        g = cfg.global_config()
        full = [i for i in range(cfg.num_layers) if cfg.layer_window(i) is None]
        width = len(str(max(full))) if full else 1
        overrides = {k: v for k, v in (("head_dim", g.head_dim), ("num_key_value_heads", g.num_kv_heads))
                     if v != getattr(cfg, "head_dim" if k == "head_dim" else "num_kv_heads")}
        return {"hidden_activation": cfg.hidden_act, "global_head_dim": None, "num_global_key_value_heads": None,
                "per_layer_config": {str(i).zfill(width): overrides for i in full} if overrides else {},
                "rope_parameters": {"full_attention": rope(cfg.rope_theta, cfg.rope_scaling),
                                    "sliding_attention": rope(cfg.local_rope_theta, cfg.local_rope_scaling)},
                "final_logit_softcapping": cfg.final_logit_softcapping,
                "hidden_size_per_layer_input": cfg.per_layer_input_size,
                "vocab_size_per_layer_input": cfg.per_layer_vocab_size or cfg.vocab_size,
                "num_kv_shared_layers": cfg.kv_shared_layers, "attention_k_eq_v": g.attention_k_eq_v,
                "use_double_wide_mlp": cfg.double_wide_mlp,
                "enable_moe_block": cfg.moe is not None,
                **({} if cfg.moe is None else {"num_experts": cfg.moe.num_experts,
                                               "top_k_experts": cfg.moe.experts_per_token,
                                               "moe_intermediate_size": cfg.moe.expert_intermediate_size})}


def _gemma4_moe(hf: dict[str, Any], act: str) -> MoEConfig | None:
    """Gemma 4's MoE block (`enable_moe_block`) as transformers' Gemma4TextRouter / Gemma4TextExperts define it;
    None without it. Its three sizes have no defaults in Gemma4TextConfig: each must be given."""
    if not hf.get("enable_moe_block"):
        return None
    missing = [k for k in ("num_experts", "top_k_experts", "moe_intermediate_size") if not hf.get(k)]
    if missing:
        raise ModelConfigError(f"gemma4: enable_moe_block true needs {', '.join(missing)} (positive integers)")
    if act != "gelu_pytorch_tanh":
        raise ModelConfigError(f"gemma4: the MoE block's experts with hidden_activation {act!r} are not supported "
                               "(gelu_pytorch_tanh: GeGLU experts)")
    return MoEConfig(num_experts=int(hf["num_experts"]), experts_per_token=int(hf["top_k_experts"]),
                     expert_intermediate_size=int(hf["moe_intermediate_size"]), norm_topk_prob=True,
                     activation="geglu", router_input_norm=float(hf.get("rms_norm_eps", 1e-6)),
                     per_expert_scale=True)


def _gemma4_shape(hf: dict[str, Any]) -> tuple[int, int]:
    """(head_dim, num_key_value_heads) as ModelConfig.from_hf reads them for every family."""
    heads = int(hf["num_attention_heads"])
    return int(hf.get("head_dim") or int(hf["hidden_size"]) // heads), int(hf.get("num_key_value_heads") or heads)


def _gemma4_global_attention(hf: dict[str, Any], types: list[str]) -> GlobalAttention:
    """The full-attention layers' shape, read as transformers 5.17's Gemma4TextConfig reads it: a
    `per_layer_config` ({layer: {head_dim, num_key_value_heads}}, what its save_pretrained writes) when config.json
    has one, else `global_head_dim` (default 512) for every full layer, with `num_global_key_value_heads` as their kv
    heads only under `attention_k_eq_v` (the published checkpoints' spelling). `attention_k_eq_v` drops the full
    layers' v_proj (Gemma4TextAttention's `use_alternative_attention`). Refused by name: an override of a sliding
    layer, of any other key, or full layers that differ from each other (transformers' rope reads one config per
    layer type)."""
    head_dim, kv = _gemma4_shape(hf)
    k_eq_v = bool(hf.get("attention_k_eq_v", False))
    full = [i for i, t in enumerate(types) if t == "full_attention"]
    if "per_layer_config" in hf:
        overrides = {}
        for key, change in (hf["per_layer_config"] or {}).items():
            layer = int(key)
            if not 0 <= layer < len(types) or types[layer] != "full_attention":
                raise ModelConfigError(f"gemma4: per_layer_config[{key!r}] overrides layer {layer}, not a "
                                       "full_attention layer (only the full layers' head_dim / num_key_value_heads "
                                       "may differ)")
            unknown = sorted(set(change) - {"head_dim", "num_key_value_heads"})
            if unknown:
                raise ModelConfigError(f"gemma4: per_layer_config[{key!r}] sets {unknown}: transformers' Gemma 4 "
                                       "reads only head_dim / num_key_value_heads per layer")
            overrides[layer] = dict(change)
        shapes = {(int(overrides.get(i, {}).get("head_dim", head_dim)),
                   int(overrides.get(i, {}).get("num_key_value_heads", kv))) for i in full}
        if len(shapes) > 1:
            raise ModelConfigError(f"gemma4: per_layer_config gives the full_attention layers different shapes "
                                   f"{sorted(shapes)} (transformers' rope reads one config per layer type)")
        (g_head, g_kv), = shapes or {(head_dim, kv)}
    else:
        g_head = hf.get("global_head_dim", 512)
        if not isinstance(g_head, int) or g_head <= 0:
            raise ModelConfigError(f"gemma4: global_head_dim {g_head!r} must be a positive integer (the "
                                   "full_attention layers' head size; or give per_layer_config)")
        g_kv = hf.get("num_global_key_value_heads") if k_eq_v else None
        g_kv = kv if g_kv is None else int(g_kv)
    return GlobalAttention(head_dim=int(g_head), num_kv_heads=int(g_kv), k_eq_v=k_eq_v)


LAYER_TYPES = ("linear_attention", "full_attention")
LFM2_LAYER_TYPES = ("conv", "full_attention")


def lfm2_aliases(hf: dict[str, Any]) -> dict[str, Any]:
    """LFM2's older config.json spellings, as transformers' Lfm2Config reads them: `block_ff_dim` (when present)
    is the intermediate size and `tie_embedding` the embedding tie."""
    hf = dict(hf)
    if "block_ff_dim" in hf:
        hf["intermediate_size"] = hf.pop("block_ff_dim")
    if "tie_embedding" in hf:
        hf["tie_word_embeddings"] = hf.pop("tie_embedding")
    return hf


def lfm2_ff_dim(hf: dict[str, Any]) -> int:
    """The width of LFM2's SwiGLU (transformers' Lfm2MLP): with `block_auto_adjust_ff_dim` (default true)
    int(2 * intermediate_size / 3), then with a `block_ffn_dim_multiplier` (default 1.0; null skips this step)
    int(multiplier * that) rounded up to a multiple of `block_multiple_of` (default 256)."""
    width = int(hf["intermediate_size"])
    if not hf.get("block_auto_adjust_ff_dim", True):
        return width
    width = int(2 * width / 3)
    multiplier = hf.get("block_ffn_dim_multiplier", 1.0)
    if multiplier is not None:
        of = int(hf.get("block_multiple_of", 256))
        if of < 1:
            raise ModelConfigError(f"block_multiple_of {of} must be >= 1")
        width = int(multiplier * width)
        width = of * ((width + of - 1) // of)
    return width


def short_conv_from_hf(hf: dict[str, Any]) -> ShortConvConfig:
    """LFM2's layer kinds (`layer_types` of conv / full_attention, or, without it, an older config's
    `full_attn_idxs`: those layers attention, the rest conv; neither: every layer attention, as transformers
    builds it) and its conv (`conv_L_cache`, `conv_bias`)."""
    L = int(hf["num_hidden_layers"])
    types = hf.get("layer_types")
    if types is None:
        idxs = hf.get("full_attn_idxs")
        idxs = set(range(L) if idxs is None else idxs)
        types = ["full_attention" if i in idxs else "conv" for i in range(L)]
    types = _checked_layer_types(types, L, LFM2_LAYER_TYPES)
    return ShortConvConfig(layers=tuple(t == "conv" for t in types), kernel=int(hf.get("conv_L_cache", 3)),
                           bias=bool(hf.get("conv_bias", False)))


def short_conv_to_hf(cfg: "ModelConfig") -> dict[str, Any]:
    """LFM2's keys: the layer kinds (layer_types and full_attn_idxs alike), the conv, `norm_eps`, and the MLP width:
    the read intermediate_size / block_* keys when they still give `cfg.intermediate_size`, else the width itself
    with block_auto_adjust_ff_dim false."""
    sc = cfg.short_conv
    layers = {"layer_types": [LFM2_LAYER_TYPES[0] if conv else LFM2_LAYER_TYPES[1] for conv in sc.layers],
              "conv_L_cache": sc.kernel, "conv_bias": sc.bias, "norm_eps": cfg.rms_norm_eps}
    if cfg.moe is not None:  # lfm2_moe: intermediate_size as is (no block_* keys), no full_attn_idxs
        return layers | {"intermediate_size": cfg.intermediate_size, "num_dense_layers": cfg.dense_layers}
    read = lfm2_aliases(cfg.hf_extra)
    read = {k: read[k] for k in ("intermediate_size", "block_auto_adjust_ff_dim", "block_ffn_dim_multiplier",
                                  "block_multiple_of") if k in read}
    if "intermediate_size" not in read or lfm2_ff_dim(read) != cfg.intermediate_size:
        read = {"intermediate_size": cfg.intermediate_size, "block_auto_adjust_ff_dim": False}
    return read | layers | {"full_attn_idxs": [i for i, conv in enumerate(sc.layers) if not conv]}


def _checked_layer_types(types, num_layers: int, allowed: tuple[str, ...]) -> list[str]:
    """A hybrid's `layer_types`: one entry per layer, each one of `allowed`."""
    types = list(types)
    if len(types) != num_layers:
        raise ModelConfigError(f"layer_types has {len(types)} entries, num_hidden_layers is {num_layers}")
    unknown = sorted(set(types) - set(allowed))
    if unknown:
        raise ModelConfigError(f"layer_types {unknown} are not supported ({', '.join(allowed)})")
    return types


def linear_attention_from_hf(hf: dict[str, Any]) -> LinearAttentionConfig:
    """A hybrid's layer kinds and Gated DeltaNet shape: `layer_types` (or, without it, every
    `full_attention_interval`-th layer full attention, as transformers builds it) and the `linear_*` keys."""
    L = int(hf["num_hidden_layers"])
    types = hf.get("layer_types")
    if types is None:
        interval = int(hf.get("full_attention_interval", 4))
        types = ["full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(L)]
    types = _checked_layer_types(types, L, LAYER_TYPES)
    return LinearAttentionConfig(
        layers=tuple(t == "linear_attention" for t in types),
        num_key_heads=int(hf.get("linear_num_key_heads", 16)), num_value_heads=int(hf.get("linear_num_value_heads", 32)),
        key_head_dim=int(hf.get("linear_key_head_dim", 128)), value_head_dim=int(hf.get("linear_value_head_dim", 128)),
        conv_kernel=int(hf.get("linear_conv_kernel_dim", 4)))


def linear_attention_to_hf(la: LinearAttentionConfig) -> dict[str, Any]:
    return {"layer_types": [LAYER_TYPES[0] if lin else LAYER_TYPES[1] for lin in la.layers],
            "linear_num_key_heads": la.num_key_heads, "linear_num_value_heads": la.num_value_heads,
            "linear_key_head_dim": la.key_head_dim, "linear_value_head_dim": la.value_head_dim,
            "linear_conv_kernel_dim": la.conv_kernel}


def _mrope_section(rs: dict[str, Any], default: tuple[int, int, int]) -> tuple[int, int, int]:
    """The multimodal rope sections (`rope_parameters.mrope_section`: the rotary frequencies given to the temporal /
    height / width position ids; the family's default when absent, as transformers' rotary reads it). transformers
    5.17 always interleaves them (Qwen3VLTextRotaryEmbedding / Qwen3_5's `recomposition_frequencies`), so
    `mrope_interleaved: false` (a layout it would not honour) is refused. Sections that do not sum to the rotary
    dim / 2 are refused where they are used (3-D rope positions: vision/mrope.py); text alone never reads them."""
    section = rs.get("mrope_section", list(default))
    if not isinstance(section, list) or len(section) != 3 or any(not isinstance(s, int) or s < 0 for s in section):
        raise ModelConfigError(f"rope_parameters.mrope_section {section!r} must be three non-negative integers "
                               "(temporal, height, width)")
    if rs.get("mrope_interleaved", True) is not True:
        raise ModelConfigError(f"rope_parameters.mrope_interleaved {rs['mrope_interleaved']!r}: transformers 5.17 "
                               "interleaves the sections for this family whatever the key says; only true is accepted")
    return tuple(section)


def moe_from_hf(style: str | None, hf: dict[str, Any]) -> MoEConfig | None:
    """The MoE section of a family's config.json (`style` is the registry's `Family.moe`); None for dense families.

    Key names differ by family: qwen3_moe writes `num_experts` / `moe_intermediate_size` (its
    `intermediate_size` is the dense MLP's, used by no layer when every layer is sparse); mixtral and gpt_oss
    write `num_local_experts` and the expert size as `intermediate_size`. qwen2_moe is qwen3_moe's spelling plus a
    shared expert (`shared_expert_intermediate_size`); qwen3_5_moe the same with the top-k always renormalised
    (no `norm_topk_prob` key) and no dense layers.
    """
    if style is None:
        return None
    k = int(hf.get("num_experts_per_tok", 2))
    coef = float(hf.get("router_aux_loss_coef", 0.001))
    if style == "qwen2_moe":
        return _qwen2_moe(hf, k, coef)
    if style == "qwen3_5_moe":
        return _qwen3_5_moe(hf, k, coef)
    if style == "lfm2_moe":
        return _lfm2_moe(hf)
    if style == "qwen3_vl_moe":  # qwen3_moe's keys; the top-k always renormalised (Qwen3VLMoeTextTopKRouter)
        if hf.get("norm_topk_prob", True) is not True:
            raise ModelConfigError(f"qwen3_vl_moe: norm_topk_prob {hf['norm_topk_prob']!r} is not read by "
                                   "transformers (its router always renormalises the top-k); remove it")
        return dataclasses.replace(moe_from_hf("qwen3_moe", {**hf, "norm_topk_prob": True}), norm_topk_prob=True)
    if style == "qwen3_moe":
        dense = list(hf.get("mlp_only_layers") or [])
        step = int(hf.get("decoder_sparse_step", 1))
        # published configs write num_experts; transformers 5 writes its attribute_map target num_local_experts
        num_experts = int(hf.get("num_experts", hf.get("num_local_experts", 128)))
        if dense or step != 1 or num_experts == 0:
            raise ModelConfigError(
                f"qwen3_moe with dense layers (mlp_only_layers {dense}, decoder_sparse_step {step}, num_experts "
                f"{num_experts}) is not supported: every layer must be sparse (the layer stack is one "
                f"scanned block type); published Qwen3-MoE models have mlp_only_layers [] and decoder_sparse_step 1")
        return MoEConfig(num_experts=num_experts, experts_per_token=k,
                         expert_intermediate_size=int(hf.get("moe_intermediate_size", 768)),
                         norm_topk_prob=bool(hf.get("norm_topk_prob", False)), router_aux_loss_coef=coef)
    if style == "mixtral":
        if float(hf.get("router_jitter_noise") or 0.0) != 0.0:
            raise ModelConfigError(f"router_jitter_noise {hf['router_jitter_noise']} is not supported (only 0: "
                                   "no multiplicative noise on the router input)")
        return MoEConfig(num_experts=int(hf.get("num_local_experts", 8)), experts_per_token=k,
                         expert_intermediate_size=int(hf["intermediate_size"]), norm_topk_prob=True,
                         router_aux_loss_coef=coef)
    if style == "gpt_oss":
        return MoEConfig(num_experts=int(hf.get("num_local_experts", 128)), experts_per_token=k,
                         expert_intermediate_size=int(hf["intermediate_size"]), router="topk_softmax",
                         router_bias=True, expert_bias=True, activation="swiglu_clamped",
                         swiglu_limit=float(hf.get("swiglu_limit", 7.0)), router_aux_loss_coef=coef)
    raise ModelConfigError(f"unknown MoE style {style!r}")


def _qwen2_moe(hf: dict[str, Any], k: int, coef: float) -> MoEConfig:
    """qwen2_moe's MoE keys (transformers' Qwen2MoeConfig defaults). Every layer must be sparse: a layer in
    `mlp_only_layers`, or one that `decoder_sparse_step` skips, would be a dense SwiGLU of `intermediate_size`
    in a stack of one scanned block type; such configs are refused by the key that asks for them."""
    dense = list(hf.get("mlp_only_layers") or [])
    if dense:
        raise ModelConfigError(f"qwen2_moe: mlp_only_layers {dense} is not supported (those layers would be dense "
                               "MLPs; surojax runs qwen2_moe with every layer sparse: mlp_only_layers [])")
    step = int(hf.get("decoder_sparse_step", 1))
    if step != 1:
        raise ModelConfigError(f"qwen2_moe: decoder_sparse_step {step} is not supported (only every "
                               f"{step}th layer would be sparse; surojax runs qwen2_moe with every layer sparse: "
                               "decoder_sparse_step 1)")
    num_experts = int(hf.get("num_experts", 60))
    if num_experts <= 0:
        raise ModelConfigError(f"qwen2_moe: num_experts {num_experts} makes every layer dense; use a dense family")
    return MoEConfig(num_experts=num_experts, experts_per_token=k,
                     expert_intermediate_size=int(hf.get("moe_intermediate_size", 1408)),
                     norm_topk_prob=bool(hf.get("norm_topk_prob", False)), router_aux_loss_coef=coef,
                     shared_expert_intermediate_size=int(hf.get("shared_expert_intermediate_size", 5632)))


def _qwen3_5_moe(hf: dict[str, Any], k: int, coef: float) -> MoEConfig:
    """qwen3_5_moe's MoE keys (transformers' Qwen3_5MoeTextConfig: every layer sparse, the top-k weights always
    renormalised, a shared expert). Its config class has no `norm_topk_prob`, `mlp_only_layers` or
    `decoder_sparse_step` (transformers ignores them): a value asking for other behaviour is refused by its key."""
    if hf.get("norm_topk_prob", True) is not True:
        raise ModelConfigError(f"qwen3_5_moe: norm_topk_prob {hf['norm_topk_prob']!r} is not supported (the family "
                               "always renormalises the top-k routing weights; transformers does not read the key)")
    if hf.get("mlp_only_layers") or int(hf.get("decoder_sparse_step", 1)) != 1:
        raise ModelConfigError(f"qwen3_5_moe: mlp_only_layers {hf.get('mlp_only_layers')} / decoder_sparse_step "
                               f"{hf.get('decoder_sparse_step')} are not supported (every layer of the family is "
                               "sparse; transformers does not read these keys)")
    num_experts = int(hf.get("num_experts", 256))
    shared = int(hf.get("shared_expert_intermediate_size", 512))
    if num_experts <= 0 or shared <= 0:
        raise ModelConfigError(f"qwen3_5_moe: num_experts {num_experts} and shared_expert_intermediate_size {shared} "
                               "must be positive (every layer has routed experts and the shared expert)")
    return MoEConfig(num_experts=num_experts, experts_per_token=k,
                     expert_intermediate_size=int(hf.get("moe_intermediate_size", 512)), norm_topk_prob=True,
                     router_aux_loss_coef=coef, shared_expert_intermediate_size=shared)


def _lfm2_moe(hf: dict[str, Any]) -> MoEConfig:
    """lfm2_moe's MoE keys (transformers' Lfm2MoeConfig defaults): sigmoid scores, the k experts chosen by score +
    the `expert_bias` buffer (`use_expert_bias`), the k scores renormalised (`norm_topk_prob`, w / (sum + 1e-6))
    and times `routed_scaling_factor`. The config class has no load-balancing coefficient: 0 unless given.
    `num_dense_layers` (the dense leading layers) is ModelConfig.dense_layers."""
    num_experts = int(hf.get("num_experts", 32))
    return MoEConfig(num_experts=num_experts, experts_per_token=int(hf.get("num_experts_per_tok", 4)),
                     expert_intermediate_size=int(hf.get("moe_intermediate_size", 1792)), router="sigmoid_topk",
                     norm_topk_prob=bool(hf.get("norm_topk_prob", True)), norm_topk_eps=1e-6,
                     selection_bias=bool(hf.get("use_expert_bias", True)),
                     routed_scaling_factor=float(hf.get("routed_scaling_factor", 1.0)),
                     router_aux_loss_coef=float(hf.get("router_aux_loss_coef", 0.0)))


def moe_to_hf(style: str, moe: MoEConfig) -> dict[str, Any]:
    """The config.json keys of `moe` in the spelling of the family's MoE `style` (inverse of `moe_from_hf`)."""
    out: dict[str, Any] = {"num_experts_per_tok": moe.experts_per_token,
                           "router_aux_loss_coef": moe.router_aux_loss_coef}
    if style in ("qwen3_moe", "qwen2_moe"):
        out.update(num_experts=moe.num_experts, moe_intermediate_size=moe.expert_intermediate_size,
                   norm_topk_prob=moe.norm_topk_prob, decoder_sparse_step=1, mlp_only_layers=[])
    elif style == "qwen3_5_moe":
        out.update(num_experts=moe.num_experts, moe_intermediate_size=moe.expert_intermediate_size)
    elif style == "qwen3_vl_moe":  # the top-k always renormalised: no norm_topk_prob key
        out.update(num_experts=moe.num_experts, moe_intermediate_size=moe.expert_intermediate_size,
                   decoder_sparse_step=1, mlp_only_layers=[])
    elif style == "lfm2_moe":
        out.update(num_experts=moe.num_experts, moe_intermediate_size=moe.expert_intermediate_size,
                   norm_topk_prob=moe.norm_topk_prob, use_expert_bias=moe.selection_bias,
                   routed_scaling_factor=moe.routed_scaling_factor)
    else:
        out.update(num_local_experts=moe.num_experts, intermediate_size=moe.expert_intermediate_size)
    if style == "gpt_oss":
        out["swiglu_limit"] = moe.swiglu_limit
    if moe.shared_expert_intermediate_size:
        out["shared_expert_intermediate_size"] = moe.shared_expert_intermediate_size
    return out


def _windows_from_layer_types(hf: dict[str, Any]) -> tuple[int | None, tuple[int | None, ...] | None]:
    """HF `layer_types` + `sliding_window` -> (sliding_window, layer_windows), as transformers' attention reads
    them: a "sliding_attention" layer gets `sliding_window` (None when `use_sliding_window` is false: full), a
    "full_attention" layer full attention. Every layer alike collapses to (that window, None)."""
    types = list(hf["layer_types"])
    if len(types) != int(hf["num_hidden_layers"]):
        raise ModelConfigError(f"layer_types has {len(types)} entries, num_hidden_layers is {hf['num_hidden_layers']}")
    unknown = sorted(set(types) - {"sliding_attention", "full_attention"})
    if unknown:
        raise ModelConfigError(f"layer_types {unknown} are not supported (sliding_attention, full_attention)")
    window = hf.get("sliding_window")
    window = None if hf.get("use_sliding_window") is False or not window else int(window)
    windows = tuple(window if t == "sliding_attention" else None for t in types)
    if len(set(windows)) == 1:
        return windows[0], None
    return window, windows


def rope_inv_freq(cfg: ModelConfig) -> list[float]:
    """Inverse rotary frequencies [H/2] after scaling (any rope_type), computed on the host."""
    if cfg.rope_scaling.rope_type == "yarn":
        return yarn_inv_freq(cfg)
    return llama3_inv_freq(cfg)


def rope_attention_factor(cfg: ModelConfig) -> float:
    """The factor transformers multiplies cos and sin by (in fp32, before the cast): 1 except for yarn."""
    rs = cfg.rope_scaling
    if rs.rope_type != "yarn":
        return 1.0
    if rs.attention_factor is not None:
        return rs.attention_factor
    if rs.mscale and rs.mscale_all_dim:
        return _yarn_mscale(rs.factor, rs.mscale) / _yarn_mscale(rs.factor, rs.mscale_all_dim)
    return _yarn_mscale(rs.factor)


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def yarn_inv_freq(cfg: ModelConfig) -> list[float]:
    """YaRN [H/2], as transformers' `_compute_yarn_parameters`: frequencies rotating more than beta_fast times
    over the original context keep their value (extrapolation), those rotating fewer than beta_slow times are
    divided by `factor` (interpolation), a linear ramp over the frequency index in between.

    Step for step in fp32 as transformers computes it (its pow is correctly rounded: float64 pow, cast), so the
    result is bit-identical: at positions near 1e5 one ulp of a frequency moves the angle by ~1e-2 rad."""
    H, base, rs = cfg.rotary_dim, cfg.rope_theta, cfg.rope_scaling
    f32 = np.float32

    def correction_dim(rotations: float) -> float:  # the frequency index that rotates `rotations` times
        return H * math.log(rs.original_max_position_embeddings / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(rs.beta_fast), correction_dim(rs.beta_slow)
    if rs.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, H - 1)
    if low == high:
        high += 0.001  # as transformers: no zero-width ramp
    exponent = (np.arange(0, H, 2, dtype=f32) / f32(H)).astype(np.float64)
    pos_freqs = np.power(np.float64(base), exponent).astype(f32)  # [H/2]
    extrapolation = f32(1.0) / pos_freqs
    interpolation = f32(1.0) / (f32(rs.factor) * pos_freqs)
    ramp = np.clip((np.arange(H // 2, dtype=f32) - f32(low)) / f32(high - low), f32(0), f32(1))  # 0: extrapolate
    keep = f32(1) - ramp
    return (interpolation * (f32(1) - keep) + extrapolation * keep).tolist()


def llama3_inv_freq(cfg: ModelConfig) -> list[float]:
    """Inverse rotary frequencies [H/2] after default / linear / llama3 scaling, computed in float64 on the host (as HF does in fp32).
    H is the rotary dim (head_dim, or its rotated part with partial_rotary_factor < 1)."""
    H = cfg.rotary_dim
    inv = [1.0 / (cfg.rope_theta ** (i / H)) for i in range(0, H, 2)]
    rs = cfg.rope_scaling
    if rs.rope_type == "proportional":  # the first `angles` frequencies over the whole head_dim, the rest zero
        angles = int(rs.partial_rotary_factor * H // 2)
        return [f / rs.factor for f in inv[:angles]] + [0.0] * (H // 2 - angles)
    if rs.rope_type == "linear":
        return [f / rs.factor for f in inv]
    if rs.rope_type != "llama3":
        return inv
    low_wavelen = rs.original_max_position_embeddings / rs.low_freq_factor
    high_wavelen = rs.original_max_position_embeddings / rs.high_freq_factor
    out = []
    for f in inv:
        wavelen = 2 * math.pi / f
        if wavelen > low_wavelen:
            out.append(f / rs.factor)
        elif wavelen < high_wavelen:
            out.append(f)
        else:
            smooth = (rs.original_max_position_embeddings / wavelen - rs.low_freq_factor) / (
                rs.high_freq_factor - rs.low_freq_factor)
            out.append((1 - smooth) * f / rs.factor + smooth * f)
    return out
