"""Multi-token prediction (MTP) heads, as Qwen3.5 / Qwen3.6 checkpoints ship them (`mtp.*`, config key
`mtp_num_hidden_layers`): a one-layer predictor of the token after next, used as a speculative proposer.

transformers does not run these weights; the definition followed is vLLM's (Qwen3_5MultiTokenPredictor): for the
token t_{p+1} and the target's final-normed hidden state h_p at position p,

    x = fc([pre_fc_norm_embedding(embed(t_{p+1})) | pre_fc_norm_hidden(h_p)])      fc: [2D] -> [D], no bias
    g = norm(Block(x))        one full-attention decoder layer (`mtp.layers.0`, dense or MoE as the model's),
                              at rope position p, attending over the MTP layer's own keys / values of 0 .. p
    logits = lm_head(g)       the target's head (and the target's embedding above: the checkpoint has neither)

predicts t_{p+2}. Chained speculation feeds its own g as the next h (vLLM's MTP proposer does the same).

`MTPDecoder` is a `Decoder` of one attention layer (`mtp_config`: the model's config with one full-attention layer
and no linear layers; the Block, its gated attention, (1 + w) norms and MLP / MoE are the decoder's own code) plus
the two input norms and `fc`; `predict` runs it. Its `embed` / `lm_head` are the target's modules (shared, not
copied: weights/mtp_checkpoint.py `load_mtp` sets them). Only the first MTP layer is loaded and run (every
published Qwen3.5 / 3.6 checkpoint has one).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from surojax.models.config import ModelConfig
from surojax.models.decoder import Decoder
from surojax.models.layer_runner import HiddenStates, LayerRunner
from surojax.models.layers.linear import Linear
from surojax.models.layers.norm import RMSNorm

MTP_PREFIX = "mtp."
MTP_LAYERS_KEY = "mtp_num_hidden_layers"
# the model types whose checkpoints ship MTP heads in this layout (vLLM's Qwen3_5MTP / Qwen3_5MoeMTP)
MTP_FAMILIES = ("qwen3_5", "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text")


def mtp_num_layers(cfg: ModelConfig) -> int:
    """config.json's `mtp_num_hidden_layers` (a multimodal config's `text_config` first); 0 when absent."""
    extra = cfg.hf_extra
    text = extra.get("text_config") if isinstance(extra.get("text_config"), dict) else {}
    value = text.get(MTP_LAYERS_KEY, extra.get(MTP_LAYERS_KEY, 0))
    return int(value or 0)


def mtp_config(cfg: ModelConfig) -> ModelConfig:
    """The MTP layer's decoder config: the model's, with one full-attention layer (no linear-attention layers)."""
    return cfg.replace(num_layers=1, linear_attention=None)


class MTPDecoder(Decoder):
    """One MTP layer over the target model's embedding and head (module docstring)."""

    def __init__(self, cfg: ModelConfig, *, dtype=jnp.float32, param_dtype=jnp.float32, attention="auto",
                 rngs: nnx.Rngs):
        """cfg: the TARGET model's config (the MTP layer's is `mtp_config(cfg)`)."""
        super().__init__(mtp_config(cfg), dtype=dtype, param_dtype=param_dtype, attention=attention, rngs=rngs)
        D, eps, zc = cfg.hidden_size, cfg.rms_norm_eps, cfg.norm_zero_centered
        self.pre_fc_norm_embedding = RMSNorm(D, eps, "embed", param_dtype=param_dtype, rngs=rngs, zero_centered=zc)
        self.pre_fc_norm_hidden = RMSNorm(D, eps, "embed", param_dtype=param_dtype, rngs=rngs, zero_centered=zc)
        self.fc = Linear(2 * D, D, (None, "embed"), param_dtype=param_dtype, rngs=rngs)

    def predict(self, tokens, hidden, positions, segment_ids, *, cache=None,
                runner: LayerRunner | None = None) -> HiddenStates:
        """tokens [B, T] (t_{p+1}), hidden [B, T, D] (h_p: the target's final-normed hidden states, or this head's
        previous output when chained), positions [B, T] (p) -> HiddenStates(g [B, T, D] after `mtp.norm`, the
        cache, router stats); `self.logits(g)` gives the next-next token's logits."""
        e = self.pre_fc_norm_embedding(self.embed_tokens(tokens))
        h = self.pre_fc_norm_hidden(hidden.astype(self.dtype))
        x = self.fc(jnp.concatenate([e, h], axis=-1))
        return self.hidden_states(tokens, positions, segment_ids, cache=cache, runner=runner, inputs=x)


def share_target_weights(mtp: MTPDecoder, target: Decoder) -> MTPDecoder:
    """The MTP head reads the target's embedding and LM head (the same modules; nothing copied)."""
    mtp.embed = target.embed
    mtp.lm_head = target.lm_head
    mtp.head_gemv = target.head_gemv
    return mtp


def full_sequence_logits(mtp: MTPDecoder, tokens: jax.Array, hidden: jax.Array) -> jax.Array:
    """The MTP head over whole sequences without a cache (tests, offline checks): tokens [B, T], the target's
    hidden states [B, T, D] -> logits [B, T - 1, V], row p predicting t_{p+2} from (t_{p+1}, h_p)."""
    B, T = tokens.shape
    positions = jnp.broadcast_to(jnp.arange(T - 1, dtype=jnp.int32), (B, T - 1))
    g = mtp.predict(tokens[:, 1:], hidden[:, :-1], positions, jnp.ones_like(positions)).hidden
    return mtp.logits(g)


__all__ = ["MTPDecoder", "MTP_FAMILIES", "MTP_LAYERS_KEY", "MTP_PREFIX", "full_sequence_logits", "mtp_config",
           "mtp_num_layers", "share_target_weights"]
