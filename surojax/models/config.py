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

from surojax.models.registry import family_for


class ModelConfigError(ValueError):
    """A config.json that surojax cannot turn into a ModelConfig."""

    is_user_error = True


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """Rotary-embedding frequency scaling. `rope_type` is 'default', 'linear' or 'llama3'."""

    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


ROUTERS = ("softmax_topk", "topk_softmax")
EXPERT_ACTIVATIONS = ("swiglu", "swiglu_clamped")


@dataclasses.dataclass(frozen=True)
class MoEConfig:
    """The sparse feed-forward of a mixture-of-experts family (every layer of the stack is sparse).

    router          "softmax_topk": softmax over the E logits, then the k largest probabilities (qwen3_moe,
                    mixtral); "topk_softmax": the k largest logits, then a softmax over those k (gpt_oss)
    norm_topk_prob  renormalise the k weights of "softmax_topk" to sum to 1 (mixtral always does)
    activation      "swiglu": silu(gate) * up with gate | up the two halves of the fused gate_up projection;
                    "swiglu_clamped" (gpt_oss): gate/up interleaved, clamped to `swiglu_limit`,
                    (up + 1) * gate * sigmoid(swiglu_alpha * gate)
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

    def __post_init__(self):
        if not 0 < self.experts_per_token <= self.num_experts:
            raise ModelConfigError(f"num_experts_per_tok ({self.experts_per_token}) must be in 1..num_experts "
                                   f"({self.num_experts})")
        if self.expert_intermediate_size <= 0:
            raise ModelConfigError(f"the experts' intermediate size must be positive, got "
                                   f"{self.expert_intermediate_size}")
        if self.router not in ROUTERS:
            raise ModelConfigError(f"router {self.router!r} is not one of {', '.join(ROUTERS)}")
        if self.activation not in EXPERT_ACTIVATIONS:
            raise ModelConfigError(f"expert activation {self.activation!r} is not one of "
                                   f"{', '.join(EXPERT_ACTIVATIONS)}")

    def expert_params(self, hidden: int) -> int:
        """Parameters of one expert: gate and up [D, F], down [F, D] (+ biases)."""
        F = self.expert_intermediate_size
        return 3 * hidden * F + ((2 * F + hidden) if self.expert_bias else 0)

    def router_params(self, hidden: int) -> int:
        return hidden * self.num_experts + (self.num_experts if self.router_bias else 0)


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
    hidden_act: str = "silu"
    bos_token_id: int | None = None
    eos_token_id: int | tuple[int, ...] | None = None
    pad_token_id: int | None = None
    moe: MoEConfig | None = None  # a mixture-of-experts feed-forward in every layer (None: the dense SwiGLU MLP)
    # The HF config.json this came from, kept so that to_hf() can write back what surojax does not model.
    hf_extra: dict[str, Any] = dataclasses.field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self):
        if self.num_heads % self.num_kv_heads:
            raise ModelConfigError(
                f"num_attention_heads ({self.num_heads}) must be a multiple of num_key_value_heads ({self.num_kv_heads})")
        if self.hidden_act not in ("silu", "swish"):
            raise ModelConfigError(f"hidden_act {self.hidden_act!r} is not supported (expected 'silu')")

    @property
    def q_dim(self) -> int:  # N * H
        return self.num_heads * self.head_dim

    @property
    def kv_dim(self) -> int:  # K * H
        return self.num_kv_heads * self.head_dim

    def num_params(self) -> int:
        """Parameters of the model, embeddings included (tied embeddings counted once)."""
        D, V = self.hidden_size, self.vocab_size
        attn = D * self.q_dim + 2 * D * self.kv_dim + self.q_dim * D
        if self.attention_bias:
            attn += self.q_dim + 2 * self.kv_dim
        if self.qk_norm:
            attn += 2 * self.head_dim
        return self.num_layers * (attn + self._ffn_params(active=False) + 2 * D) \
            + V * D * (1 if self.tie_word_embeddings else 2) + D

    def num_active_params(self) -> int:
        """Parameters one token runs through: a MoE layer counts its router and k experts, not all E."""
        if self.moe is None:
            return self.num_params()
        return self.num_params() - self.num_layers * (self._ffn_params(active=False) - self._ffn_params(active=True))

    def _ffn_params(self, *, active: bool) -> int:
        D = self.hidden_size
        if self.moe is None:
            return 3 * D * self.intermediate_size
        n = self.moe.experts_per_token if active else self.moe.num_experts
        return self.moe.router_params(D) + n * self.moe.expert_params(D)

    def replace(self, **changes) -> "ModelConfig":
        return dataclasses.replace(self, **changes)

    # ---- Hugging Face config.json --------------------------------------------------------------------------
    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> "ModelConfig":
        """Build from a parsed config.json. The family's registry entry supplies the family flags."""
        family = family_for(hf.get("model_type"))
        required = ["vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads"]
        missing = [k for k in required if k not in hf]
        if missing:
            raise ModelConfigError(f"config.json lacks {', '.join(missing)} (model_type {hf.get('model_type')!r})")
        n_heads = int(hf["num_attention_heads"])
        head_dim = hf.get("head_dim") or hf["hidden_size"] // n_heads
        rs = hf.get("rope_scaling") or hf.get("rope_parameters") or {}
        rope_type = rs.get("rope_type", rs.get("type", "default")) if rs else "default"
        rope_theta = hf.get("rope_theta", rs.get("rope_theta", 10000.0) if rs else 10000.0)
        if rope_type not in ("default", "linear", "llama3"):
            raise ModelConfigError(f"rope_scaling type {rope_type!r} is not supported (default, linear, llama3)")
        scaling = RopeScaling(
            rope_type=rope_type,
            factor=float(rs.get("factor", 1.0)) if rs else 1.0,
            low_freq_factor=float(rs.get("low_freq_factor", 1.0)) if rs else 1.0,
            high_freq_factor=float(rs.get("high_freq_factor", 4.0)) if rs else 4.0,
            original_max_position_embeddings=int(rs.get("original_max_position_embeddings", 8192)) if rs else 8192,
        )
        if hf.get("mlp_bias"):
            raise ModelConfigError("mlp_bias: true is not supported (no supported family has MLP biases)")
        if hf.get("attention_bias") and not family.attention_bias:
            raise ModelConfigError(f"attention_bias: true is not supported for {family.name} "
                                   "(it would add an o_proj bias; only qwen2-style q/k/v biases are modelled)")
        sliding = hf.get("sliding_window") if family.sliding_window else None
        if family.sliding_window and hf.get("use_sliding_window") is False:
            sliding = None
        return cls(
            model_type=family.name,
            vocab_size=int(hf["vocab_size"]),
            hidden_size=int(hf["hidden_size"]),
            intermediate_size=int(hf["intermediate_size"]),
            num_layers=int(hf["num_hidden_layers"]),
            num_heads=n_heads,
            num_kv_heads=int(hf.get("num_key_value_heads") or n_heads),
            head_dim=int(head_dim),
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            rope_theta=float(rope_theta),
            rope_scaling=scaling,
            max_position_embeddings=int(hf.get("max_position_embeddings", 4096)),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", family.tie_default)),
            attention_bias=bool(hf.get("attention_bias", family.attention_bias)),
            qk_norm=family.qk_norm,
            sliding_window=int(sliding) if sliding else None,
            hidden_act=hf.get("hidden_act", "silu"),
            bos_token_id=hf.get("bos_token_id"),
            eos_token_id=tuple(hf["eos_token_id"]) if isinstance(hf.get("eos_token_id"), list) else hf.get("eos_token_id"),
            pad_token_id=hf.get("pad_token_id"),
            moe=moe_from_hf(family.moe, hf),
            hf_extra=dict(hf),
        )

    def to_hf(self) -> dict[str, Any]:
        """A config.json dict that `transformers.AutoConfig` reads back into the same architecture."""
        dropped = ("architectures", "model_type", "rope_scaling", "rope_parameters", "torch_dtype", "dtype")
        out = {k: v for k, v in self.hf_extra.items() if k not in dropped}

        family = family_for(self.model_type)
        out.update(
            architectures=[family.hf_architecture],
            model_type=self.model_type,
            vocab_size=self.vocab_size,
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
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
        # transformers >= 5 reads `rope_parameters`; older versions read rope_theta / rope_scaling.
        rope = {"rope_type": self.rope_scaling.rope_type, "rope_theta": self.rope_theta}
        if self.rope_scaling.rope_type != "default":
            rs = dataclasses.asdict(self.rope_scaling)
            rope.update(rs)
            out["rope_scaling"] = rs | {"type": rs["rope_type"]}
        out["rope_parameters"] = rope
        if family.attention_bias_key:
            out["attention_bias"] = self.attention_bias
        if family.sliding_window:
            out["sliding_window"] = self.sliding_window
        for k in ("bos_token_id", "eos_token_id", "pad_token_id"):
            if getattr(self, k) is not None:
                out[k] = getattr(self, k)
        if self.moe is not None:
            out.update(moe_to_hf(family.moe, self.moe))
        return out


def moe_from_hf(style: str | None, hf: dict[str, Any]) -> MoEConfig | None:
    """The MoE section of a family's config.json (`style` is the registry's `Family.moe`); None for dense families.

    Key names differ by family: qwen3_moe writes `num_experts` / `moe_intermediate_size` (its
    `intermediate_size` is the dense MLP's, used by no layer when every layer is sparse); mixtral and gpt_oss
    write `num_local_experts` and the expert size as `intermediate_size`.
    """
    if style is None:
        return None
    k = int(hf.get("num_experts_per_tok", 2))
    coef = float(hf.get("router_aux_loss_coef", 0.001))
    if style == "qwen3_moe":
        dense = list(hf.get("mlp_only_layers") or [])
        step = int(hf.get("decoder_sparse_step", 1))
        # transformers 5 writes `num_local_experts` (num_experts is an alias of it there); older releases num_experts
        num_experts = int(hf.get("num_experts", hf.get("num_local_experts", 128)))
        if dense or step != 1 or num_experts == 0:
            raise ModelConfigError(
                f"qwen3_moe with dense layers (mlp_only_layers {dense}, decoder_sparse_step {step}, num_experts "
                f"{hf.get('num_experts')}) is not supported: every layer must be sparse (the layer stack is one "
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


def moe_to_hf(style: str, moe: MoEConfig) -> dict[str, Any]:
    """The config.json keys of `moe` in the spelling of the family's MoE `style` (inverse of `moe_from_hf`)."""
    out: dict[str, Any] = {"num_experts_per_tok": moe.experts_per_token,
                           "router_aux_loss_coef": moe.router_aux_loss_coef}
    if style == "qwen3_moe":
        out.update(num_experts=moe.num_experts, moe_intermediate_size=moe.expert_intermediate_size,
                   norm_topk_prob=moe.norm_topk_prob, decoder_sparse_step=1, mlp_only_layers=[])
    else:
        out.update(num_local_experts=moe.num_experts, intermediate_size=moe.expert_intermediate_size)
    if style == "gpt_oss":
        out["swiglu_limit"] = moe.swiglu_limit
    return out


def llama3_inv_freq(cfg: ModelConfig) -> list[float]:
    """Inverse rotary frequencies [H/2] after scaling, computed in float64 on the host (as HF does in fp32)."""
    H = cfg.head_dim
    inv = [1.0 / (cfg.rope_theta ** (i / H)) for i in range(0, H, 2)]
    rs = cfg.rope_scaling
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
