"""The decoder: one implementation for Llama 3.x, Qwen2/2.5, Qwen3, Mistral and the MoE families (Qwen3-MoE, Mixtral).

    tokens [B, T] -> embed [B, T, D] -> L x Block -> RMSNorm -> lm_head -> logits [B, T, V]
    Block:  h += Attention(RMSNorm(h));  h += MLP(RMSNorm(h))      (pre-norm, SwiGLU, GQA, rope)
            the MLP is the dense SwiGLU, or with `cfg.moe` the mixture of experts (layers/moe.py)

Hybrid (Qwen3.5, `cfg.linear_attention`): two stacks, `layers` (the attention Blocks, with the output gate) and
`linear_layers` (`LinearBlock`s: the same pre-norm residual block with a Gated DeltaNet, layers/gated_deltanet.py,
as its token mixer); `layer_types` says which HF layer is which, and the layer pattern runs them in HF order
(the runner's mixed layer groups). RMSNorms are then zero-centred ((1 + w)) and rope partial.

Gemma 3 (`gemma3_text`, the text backbone of `gemma3`): the same Block with sandwich norms
    h += RMSNorm(Attention(RMSNorm(h)));  h += RMSNorm(GeGLU(RMSNorm(h)))      ((1 + w) norms, q/k norms)
embeddings times sqrt(D), the softmax scale query_pre_attn_scalar ** -0.5, and `layer_types`' sliding / full
layers as layer types with their window and their rope (`rope` option: the sliding layers' own base).

LFM2 (`cfg.short_conv`): likewise two stacks, `layers` (its GQA attention layers, q / k norms) and `conv_layers`
(`ConvBlock`s: the pre-norm residual block with LFM2's short convolution, layers/short_conv.py, as its token
mixer); plain (w) RMSNorms, full rope. The non-attention stack of a hybrid keeps a fixed-size state per sequence
in generation and serving (`Decoder.state_stack` / `state_shape`; kv/recurrent.py).

Gemma 4 (`gemma4_text`, the text backbone of `gemma4`): Gemma 3's block with plain-w norms,
the values RMS-normalised without a weight (v norm), softmax scale 1, the full-attention layers' `proportional`
rope, and each layer's output times its loaded `layer_scalar`:  h = layer_scalar * (h + RMSNorm(GeGLU(...))).
Full-attention layers of their own shape (`cfg.global_attention`: global_head_dim, their kv heads, attention_k_eq_v's
keys as values) are a stack of their own, `global_layers` (Blocks built from `cfg.global_config()`), beside `layers`
(the sliding ones), with their own KV cache part; the full rope's tables span their head size.
With its MoE block (`cfg.moe_beside_mlp`) the MoE runs beside the GeGLU: its router reads the residual stream h, its
experts their own pre-norm of h, each branch is post-normed and the sum post-normed (`_mlp_residual`).

Vision-language (Qwen3-VL `qwen3_vl` / `qwen3_vl_moe`, Qwen3.5 with its tower): the same decoder with the vision
tower beside it (`visual`, models/vision/): `hidden_states(images=, rope_positions=)` scatters the tower's merged
rows over the image tokens' embeddings, adds Qwen3-VL's deepstack features to those tokens after the first layers
(the layer scan's `after_layer` hook), and takes M-RoPE's cos / sin from rope_positions [3, B, T].

Families differ only by ModelConfig flags (attention bias, q/k norm, sliding window, rope scaling, tied
embeddings, the MoE section). The L blocks are stacked on a leading `layers` axis (every per-layer parameter is
[L, ...]) and run by the decoder's layer runner (surojax/models/layer_runner.py; by default `jax.lax.scan` over
the layer pattern `layer_pattern(cfg)`), so compile time does not grow with depth and remat / host streaming /
pipeline stages act on one layer slice at a time. Training settings (the runner: remat policy, unrolling; dtype
policy, LoRA, sharding) are applied from outside; none of them lives in ModelConfig.
"""
from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from pallas_kernels.decode_gemv.api import choose, decode_gemv, weight_error
from surojax.kernel_settings import kernel_settings
from surojax.models.config import ModelConfig
from surojax.models.kv import CONV_STACK, LINEAR_STACK, Cache, ConvShape, KVCache, StateShape, state_stack
from surojax.models.layer_runner import (KV_FROM, KV_STORE, HiddenStates, LayerPattern, LayerRunner, LayerScan, LayerType,
                                         on_device)
from surojax.models.layers.attention import Attention
from surojax.models.layers.attention_backend import AttentionBackend, AttentionKind, as_attention_backend
from surojax.models.layers.gated_deltanet import GatedDeltaNet
from surojax.models.layers.linear import Linear
from surojax.models.layers.mlp import ACTIVATIONS, MLP
from surojax.models.layers.moe import MoE
from surojax.models.layers.norm import RMSNorm
from surojax.models.layers.params import AXES, param
from surojax.models.layers.rope import attention_factor, inv_freq, rope_cos_sin
from surojax.models.layers.short_conv import ShortConv
from surojax.models.registry import DENSE_STACKS, GEMMA4_STACKS
from surojax.models.vision.inputs import ImageInputs
from surojax.models.vision.mrope import mrope_cos_sin
from surojax.models.vision.tower import VisionTower


class Block(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, attention: AttentionBackend | str, param_dtype,
                 rngs: nnx.Rngs | None = None):
        self.attn = Attention(cfg, backend=attention, param_dtype=param_dtype, rngs=rngs)
        _norms_and_mlp(self, cfg, param_dtype, rngs)
        # Gemma 4: the layer's output times its scalar [1] (transformers' `layer_scalar` buffer, loaded)
        self.layer_scalar = param(rngs, (1,), (None,), param_dtype, init="ones") if cfg.layer_scalar else None
        # Gemma 4's per-layer input (PLE, P = cfg.per_layer_input_size): h += norm(proj(act(gate(h)) * input))
        P, D = cfg.per_layer_input_size, cfg.hidden_size
        self.ple_gate = Linear(D, P, ("embed", None), param_dtype=param_dtype, rngs=rngs) if P else None
        self.ple_projection = Linear(P, D, (None, "embed"), param_dtype=param_dtype, rngs=rngs) if P else None
        self.ple_norm = RMSNorm(D, cfg.rms_norm_eps, "embed", param_dtype=param_dtype, rngs=rngs) if P else None
        self.ple_act = ACTIVATIONS[cfg.hidden_act] if P else None

    def __call__(self, h, cos, sin, segment_ids, positions, kv=None, kv_meta=None, window=None, rope=None, *,
                 per_layer_input=None, shared_kv=None, store_kv: bool = False):
        """-> (h, kv, router stats of a MoE layer or None). `window`: this layer's static attention window (0 =
        full), its layer type's option when the config has per-layer windows (`layer_pattern`). `rope`: with two
        ropes (Gemma 3) cos / sin are each a pair (the config's, the sliding layers') and this layer's type option
        picks one (`ModelConfig.layer_rope`). Gemma 4: `per_layer_input` [B, T, P] this layer's PLE input;
        `shared_kv` a KV-shared layer's source keys / values; `store_kv` (a source layer): also return its
        (k, v) -> (h, kv, stats, (k, v))."""
        if rope is not None:
            cos, sin = cos[rope], sin[rope]
        gemma4 = dict(shared_kv=shared_kv, store_kv=True) if store_kv or shared_kv is not None else {}
        if self.attn_post_norm is None:  # h + Attention(RMSNorm(h)), the norm and the add handed in (decode GEMV)
            h, kv = self.attn(h, cos, sin, segment_ids, positions, kv, kv_meta, window, norm=self.attn_norm,
                              residual=h)
            own = None
        else:
            a, kv, *own = self.attn(self.attn_norm(h), cos, sin, segment_ids, positions, kv, kv_meta, window,
                                    **gemma4)
            h = h + self.attn_post_norm(a)
        h, kv, stats = _mlp_residual(self, h, kv, segment_ids)
        if self.ple_gate is not None:  # Gemma 4's per-layer input, gated by the layer's output
            if per_layer_input is None:
                raise ValueError("a Gemma 4 layer with per-layer input embeddings needs its per_layer_input")
            g = self.ple_act(self.ple_gate(h)) * per_layer_input.astype(h.dtype)
            h = h + self.ple_norm(self.ple_projection(g))
        if self.layer_scalar is not None:  # Gemma 4: the whole layer's output times its scalar
            h = h * self.layer_scalar[...].astype(h.dtype)
        return (h, kv, stats, own[0]) if store_kv else (h, kv, stats)


def _mlp_residual(block: nnx.Module, h, kv, segment_ids):
    """Every block's second half: h += MLP(RMSNorm(h)) (with sandwich norms, Gemma 3: h += RMSNorm(MLP(RMSNorm(h))))
    -> (h, kv, the MoE's router stats or None). Gemma 4's MoE block beside the MLP (`block.moe`), as transformers'
    Gemma4TextDecoderLayer: h += RMSNorm(RMSNorm_1(MLP(RMSNorm(h))) + RMSNorm_2(MoE(RMSNorm'(h); router reads h)))."""
    if isinstance(block.mlp, MoE):
        m, stats = block.mlp(block.mlp_norm(h), segment_ids)
        return h + m, kv, stats
    if getattr(block, "moe", None) is not None:  # Gemma 4's MoE block beside the MLP (sandwich norms)
        e, stats = block.moe(block.moe_pre_norm(h), segment_ids, router_input=h)
        m = block.mlp_post_norm_dense(block.mlp(block.mlp_norm(h))) + block.moe_post_norm(e)
        return h + block.mlp_post_norm(m), kv, stats
    if block.mlp_post_norm is None:  # the norm and the add handed in: the decode GEMV's prologue / epilogue
        return block.mlp(h, norm=block.mlp_norm, residual=h), kv, None
    return h + block.mlp_post_norm(block.mlp(block.mlp_norm(h))), kv, None


def _norms_and_mlp(block: nnx.Module, cfg: ModelConfig, param_dtype, rngs) -> None:
    """The parts every block has: attn_norm, mlp_norm, and the MLP (dense SwiGLU / GeGLU or the MoE); with
    `cfg.sandwich_norms` (Gemma 3) also attn_post_norm / mlp_post_norm on the sublayers' outputs (None without)."""
    D, zc = cfg.hidden_size, cfg.norm_zero_centered

    def norm():
        return RMSNorm(D, cfg.rms_norm_eps, "embed", param_dtype=param_dtype, rngs=rngs, zero_centered=zc)

    block.attn_norm, block.mlp_norm = norm(), norm()
    block.attn_post_norm = norm() if cfg.sandwich_norms else None
    block.mlp_post_norm = norm() if cfg.sandwich_norms else None
    if cfg.moe is None or cfg.moe_beside_mlp:
        block.mlp = MLP(D, cfg.intermediate_size, param_dtype=param_dtype, rngs=rngs, activation=cfg.hidden_act)
    else:
        block.mlp = MoE(D, cfg.moe, param_dtype=param_dtype, rngs=rngs)
    if cfg.moe_beside_mlp:  # Gemma 4's MoE block: the MoE, its pre norm, each branch's post norm
        block.moe = MoE(D, cfg.moe, param_dtype=param_dtype, rngs=rngs)
        block.moe_pre_norm, block.mlp_post_norm_dense, block.moe_post_norm = norm(), norm(), norm()


class LinearBlock(nnx.Module):
    """A hybrid's linear-attention layer: h += GatedDeltaNet(RMSNorm(h)); h += MLP(RMSNorm(h))."""

    def __init__(self, cfg: ModelConfig, *, param_dtype, rngs: nnx.Rngs | None = None):
        self.linear_attn = GatedDeltaNet(cfg, param_dtype=param_dtype, rngs=rngs)
        _norms_and_mlp(self, cfg, param_dtype, rngs)

    def __call__(self, h, cos, sin, segment_ids, positions, kv=None, kv_meta=None):
        """-> (h, kv, router stats of a MoE layer or None), as `Block`; `kv`: this layer's recurrent-state view
        (kv/recurrent.py) or None."""
        a, kv = self.linear_attn(self.attn_norm(h), segment_ids, kv)
        return _mlp_residual(self, h + a, kv, segment_ids)


class ConvBlock(nnx.Module):
    """LFM2's short-convolution layer: h += ShortConv(RMSNorm(h)); h += MLP(RMSNorm(h))."""

    def __init__(self, cfg: ModelConfig, *, param_dtype, rngs: nnx.Rngs | None = None):
        self.conv = ShortConv(cfg.hidden_size, cfg.short_conv, param_dtype=param_dtype, rngs=rngs)
        _norms_and_mlp(self, cfg, param_dtype, rngs)

    def __call__(self, h, cos, sin, segment_ids, positions, kv=None, kv_meta=None):
        """-> (h, kv, router stats of a MoE layer or None), as `Block`; `kv`: this layer's conv-state view
        (kv/recurrent.py) or None."""
        a, kv = self.conv(self.attn_norm(h), segment_ids, kv)
        return _mlp_residual(self, h + a, kv, segment_ids)


class Embedding(nnx.Module):
    def __init__(self, vocab: int, dim: int, *, param_dtype, rngs: nnx.Rngs):
        self.embedding = param(rngs, (vocab, dim), ("vocab", "embed"), param_dtype)  # [V, D]


class LMHead(nnx.Module):
    def __init__(self, dim: int, vocab: int, *, param_dtype, rngs: nnx.Rngs):
        self.kernel = param(rngs, (dim, vocab), ("embed", "vocab"), param_dtype)  # [D, V]


def _block_maker(cfg: ModelConfig, attention, param_dtype) -> Callable[[jax.Array], "Block"]:
    """key -> a Block of `cfg` (for `_stack_blocks`)."""
    return lambda k: Block(cfg, attention=attention, param_dtype=param_dtype, rngs=nnx.Rngs(params=k))


def _stack_blocks(make: Callable[[jax.Array], nnx.Module], keys: jax.Array) -> nnx.Module:
    """Build L blocks with one key each and stack every parameter on a new leading `layers` axis."""
    stacked = nnx.vmap(make, in_axes=0, out_axes=0)(keys)
    for _, var in nnx.iter_graph(stacked):
        if isinstance(var, nnx.Variable) and AXES in var.get_metadata():
            var.set_metadata(AXES, ("layers",) + tuple(var.get_metadata()[AXES]))
    return stacked


def layer_pattern(cfg: ModelConfig) -> LayerPattern:
    """The decoder's layer pattern (surojax/models/layer_runner.py) over its one stack `layers` [L, ...]: one type,
    or with per-layer attention windows (gpt_oss's alternating sliding / full) one type per window of the
    windows' shortest period, each with its static `window` (0 = full attention). A hybrid: one type per layer
    of `layer_types`' shortest period, reading `linear_layers` (Gated DeltaNet) or `layers` (attention); Qwen3.5's
    [linear x 3, full] x G. LFM2 alike with `conv_layers` (its published patterns have no shorter period than L:
    one group of L types); lfm2_moe's dense leading layers read the stacks `dense_conv_layers` / `dense_layers` and
the cache parts of their kind (`LayerType.cache`)."""
    L = cfg.num_layers
    other = LINEAR_STACK if cfg.linear_attention is not None else CONV_STACK
    kinds = cfg.linear_attention or cfg.short_conv
    if kinds is not None:
        stacks = [other if mine else "layers" for mine in kinds.layers]
        # lfm2_moe's dense leading layers: their own stacks, their kind's cache part
        types = [LayerType(DENSE_STACKS[s], cache=s) if i < cfg.dense_layers else LayerType(s)
                 for i, s in enumerate(stacks)]
        return LayerPattern(tuple(types[:_period(types)]), L)
    if cfg.layer_windows is None and cfg.local_rope_theta is None:
        return LayerPattern.uniform(L)
    types = [_gemma4_type(cfg, i) for i in range(L)]
    return LayerPattern(tuple(types[:_period(types)]), L)


def _gemma4_type(cfg: ModelConfig, layer: int) -> LayerType:
    """Layer `layer`'s type in an attention-only pattern: its stack (`ModelConfig.layer_stack`: Gemma 4's full
    layers of their own shape read `global_layers`, its KV-shared layers `shared_layers` / `shared_global_layers`,
    each with the KV cache part of its shape), its attention options, and Gemma 4's KV sharing: a KV-shared layer
    reads (KV_FROM) the keys / values its source layer stores (KV_STORE) under the layer kind's name."""
    stack, options = cfg.layer_stack(layer), _attention_options(cfg, layer)
    kind = cfg.layer_kind(layer)
    if cfg.layer_is_kv_shared(layer):
        return LayerType(stack, options + ((KV_FROM, kind),), cache=stack.removeprefix("shared_") or "layers")
    first = cfg.num_layers - cfg.kv_shared_layers
    if cfg.kv_shared_layers and any(cfg.kv_source(i) == layer for i in range(first, cfg.num_layers)):
        options += ((KV_STORE, kind),)
    return LayerType(stack, options)


def _attention_options(cfg: ModelConfig, layer: int) -> tuple:
    """Layer `layer`'s static call options: its window (0 = full) with per-layer windows, its rope (0 / 1) with
    two ropes (Gemma 3: [sliding x 5, full] x G, the sliding layers on the local rope)."""
    window = () if cfg.layer_windows is None else (("window", cfg.layer_window(layer) or 0),)
    rope = () if cfg.local_rope_theta is None else (("rope", cfg.layer_rope(layer)),)
    return window + rope


def rope_tables(cfg: ModelConfig, positions, dtype):
    """positions [B, T] -> cos, sin [B, T, H]; with two ropes (cfg.local_rope_theta: Gemma 3) each a pair
    (the config's rope, the sliding layers' rope), indexed by the layer type's `rope` option."""
    tables = [rope_cos_sin(positions, inv_freq(c), dtype, attention_factor(c)) for c in cfg.rope_configs()]
    if len(tables) == 1:
        return tables[0]
    return tuple(t[0] for t in tables), tuple(t[1] for t in tables)


def state_shape(cfg) -> StateShape | ConvShape:
    """The per-layer state layout of a hybrid's state stack: the Gated DeltaNet's heads (the config's
    `linear_attention`: a `StateShape`'s fields) or LFM2's short-conv window over the hidden size."""
    sc = getattr(cfg, "short_conv", None)
    if sc is not None:
        return ConvShape(cfg.hidden_size, sc.kernel)
    if cfg.linear_attention is None:
        raise ValueError(f"{cfg.model_type} has no layers with per-sequence state")
    return cfg.linear_attention


def _period(kinds: list) -> int:
    """The shortest p with kinds[i] == kinds[i % p] for every i."""
    L = len(kinds)
    return next(p for p in range(1, L + 1) if all(kinds[i] == kinds[i % p] for i in range(L)))

# The vision tower's parameters (`Decoder.visual`): frozen by default; a train step keeps them out of its
# differentiated state with this filter unless it trains the tower (and sets `train_vision`).
vision_filter = nnx.PathContains("visual")


class Decoder(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, dtype=jnp.float32, param_dtype=jnp.float32,
                 attention: AttentionBackend | str = "auto", rngs: nnx.Rngs):
        """dtype: activation/compute dtype; param_dtype: storage dtype of the weights; attention: the backend (its
        config spelling is parsed here: models/layers/attention_backend.py)."""
        self.cfg = cfg
        self.dtype = dtype
        D, V = cfg.hidden_size, cfg.vocab_size
        self.embed = Embedding(V, D, param_dtype=param_dtype, rngs=rngs)
        pattern = layer_pattern(cfg)
        keys = jax.random.split(rngs.params(), cfg.num_layers)
        self.layers = _stack_blocks(
            lambda k: Block(cfg, attention=attention, param_dtype=param_dtype, rngs=nnx.Rngs(params=k)),
            keys[:pattern.rows("layers")])
        self.linear_layers = None if cfg.linear_attention is None else _stack_blocks(
            lambda k: LinearBlock(cfg, param_dtype=param_dtype, rngs=nnx.Rngs(params=k)),
            keys[pattern.rows("layers"):])
        # Gemma 4's other attention stacks (full layers of their own shape, KV-shared layers) where they hold a layer
        at = pattern.rows("layers")
        for name in GEMMA4_STACKS[1:]:
            rows = pattern.rows(name) if name in pattern.stacks else 0
            setattr(self, name, None if not rows else _stack_blocks(
                _block_maker(cfg.stack_config(name), attention, param_dtype), keys[at:at + rows]))
            at += rows
        # Gemma 4's per-layer input embeddings: the table [V_p, L P], the embeddings' projection [D, L P], its norm
        P = cfg.per_layer_input_size
        self.embed_per_layer = Embedding(cfg.per_layer_vocab_size, cfg.num_layers * P, param_dtype=param_dtype,
                                         rngs=rngs) if P else None
        self.per_layer_model_projection = Linear(D, cfg.num_layers * P, ("embed", None), param_dtype=param_dtype,
                                                 rngs=rngs) if P else None
        self.per_layer_projection_norm = RMSNorm(P, cfg.rms_norm_eps, None, param_dtype=param_dtype,
                                                 rngs=rngs) if P else None
        self.conv_layers = None if cfg.short_conv is None else _stack_blocks(
            lambda k: ConvBlock(cfg, param_dtype=param_dtype, rngs=nnx.Rngs(params=k)),
            keys[pattern.rows("layers"):pattern.rows("layers") + pattern.rows(CONV_STACK)])
        # lfm2_moe's dense leading layers (cfg.dense_layers): the same blocks with the dense MLP, only where they hold
        # a layer
        dense_cfg = cfg.replace(moe=None, dense_layers=0)
        rest = keys[pattern.rows("layers") + pattern.rows(CONV_STACK):]
        self.dense_layers = None if not pattern.rows(DENSE_STACKS["layers"]) else _stack_blocks(
            lambda k: Block(dense_cfg, attention=attention, param_dtype=param_dtype, rngs=nnx.Rngs(params=k)),
            rest[:pattern.rows(DENSE_STACKS["layers"])])
        self.dense_conv_layers = None if not pattern.rows(DENSE_STACKS[CONV_STACK]) else _stack_blocks(
            lambda k: ConvBlock(dense_cfg, param_dtype=param_dtype, rngs=nnx.Rngs(params=k)),
            rest[pattern.rows(DENSE_STACKS["layers"]):])
        self.final_norm = RMSNorm(D, cfg.rms_norm_eps, "embed", param_dtype=param_dtype, rngs=rngs,
                                  zero_centered=cfg.norm_zero_centered)
        self.lm_head = None if cfg.tie_word_embeddings else LMHead(D, V, param_dtype=param_dtype, rngs=rngs)
        self.runner: LayerRunner = LayerScan()  # static (graphdef); the layer-loop transform sets it
        self.head_gemv = False  # static: a tied head through the decode GEMV at few rows (`logits`; serving sets it)
        # the vision tower (`model.visual.*`; the checkpoint loader sets it when the checkpoint holds one), and
        # whether gradients flow into it (static; False: frozen, its output under stop_gradient; the training glue
        # keeps its parameters out of the optimizer with `vision_filter`)
        self.visual: VisionTower | None = nnx.data(None)
        self.train_vision: bool = False
        # static: the tower's attention through cuDNN (bf16 / fp16 only: block.py). Off until measured on a GPU:
        # the route's arguments are checked on the CPU through the xla kernel only (tests/models/
        # test_vision_attention.py); issue 41's campaign A/Bs it (`vision_cudnn_available` says where it could run)
        self.vision_cudnn: bool = False
        self.vision_cudnn_available: bool = (as_attention_backend(attention).resolved(jax.default_backend()).kind
                                             is AttentionKind.CUDNN)

    @property
    def layer_pattern(self) -> LayerPattern:
        return layer_pattern(self.cfg)

    @property
    def stacks(self) -> dict[str, nnx.Module]:
        """The layer stacks by name: `layers`, and a hybrid's `linear_layers` or LFM2's `conv_layers` (lfm2_moe: also
        its dense leading layers' `dense_layers` / `dense_conv_layers` where they hold a layer)."""
        out = {"layers": self.layers}
        for name in (LINEAR_STACK, CONV_STACK, *GEMMA4_STACKS[1:], *DENSE_STACKS.values()):
            if getattr(self, name) is not None:
                out[name] = getattr(self, name)
        return out

    @property
    def state_stack(self) -> str | None:
        """The stack whose layers keep a fixed-size state per sequence (`linear_layers`, `conv_layers`), or None."""
        return state_stack(self.layer_pattern.caches)

    @property
    def state_shape(self) -> StateShape | ConvShape:
        """The per-layer state layout of `state_stack` (`state_shape(cfg)`)."""
        return state_shape(self.cfg)

    # ---- forward ----------------------------------------------------------------------------------------
    def embed_tokens(self, tokens) -> jax.Array:
        """tokens [B, T] -> the token embeddings [B, T, D] in the compute dtype (Gemma: times sqrt(D))."""
        h = jnp.take(on_device(self.embed.embedding[...]), tokens, axis=0)  # [B, T, D]
        if self.cfg.scale_embeddings:  # Gemma: x sqrt(D), the factor cast to the embedding's dtype (as transformers)
            h = h * jnp.asarray(np.float32(self.cfg.hidden_size ** 0.5), h.dtype)
        return h.astype(self.dtype)

    def hidden_states(self, tokens, positions, segment_ids, *, cache: Cache | None = None,
                      runner: LayerRunner | None = None, images: ImageInputs | None = None,
                      rope_positions: jax.Array | None = None, inputs: jax.Array | None = None) -> HiddenStates:
        """tokens/positions/segment_ids [B, T] -> HiddenStates(final-normed hidden [B, T, D], the updated cache or
        None, the MoE layers' `RouterStats` stacked on [L] or None).

        The layers run on `runner` (None: the decoder's own, `self.runner`, which the layer-loop transform sets;
        serving passes one per call, e.g. `CarriedCacheScan`): surojax/models/layer_runner.py. Any
        `surojax.models.kv.Cache` works; attention hands it the call's metadata (`cache.step`).

        Vision-language models (`cfg.mrope_section`; vision/inputs.py's `prepare_images` makes both inputs):
        `images` runs the vision tower (in the compute dtype; under stop_gradient unless `train_vision`), its
        merged rows replace the image tokens' embeddings and its deepstack features are added to those tokens'
        hidden states after decoder layer j (Qwen3-VL); `rope_positions` [3, B, T] give M-RoPE's cos / sin
        instead of the 1-D positions' (which still drive the attention mask and the cache).

        `inputs` [B, T, D]: the first layer's input instead of the tokens' embeddings (an MTP head's projected
        input, models/mtp.py).
        """
        h = self.embed_tokens(tokens) if inputs is None else inputs.astype(self.dtype)
        after_layer = None
        if images is not None:
            if rope_positions is None:  # transformers places image tokens by M-RoPE: 1-D positions would be wrong
                raise ValueError(f"{self.cfg.model_type}: images need rope_positions [3, B, T] (prepare_images "
                                 "gives them with the images)")
            h, after_layer = self._with_images(h, images)
        if rope_positions is None:
            cos, sin = rope_tables(self.cfg, positions, self.dtype)  # [B, T, H] each, or a pair (two ropes)
        else:
            cos, sin = self._mrope_tables(rope_positions, tokens.shape)
        kv_meta = None
        if cache is not None:
            kv_meta, cache = cache.step(segment_ids, positions)
        runner = self.runner if runner is None else runner
        extra = {}
        if after_layer is not None:
            if not isinstance(runner, LayerScan):
                raise ValueError(f"{self.cfg.model_type}: deepstack image features need the layer scan runner; "
                                 f"this call runs on {type(runner).__name__}")
            extra["after_layer"] = after_layer
        if self.embed_per_layer is not None:
            if not isinstance(runner, LayerScan):
                raise ValueError(f"{self.cfg.model_type}: per-layer input embeddings need the layer scan runner; "
                                 f"this call runs on {type(runner).__name__}")
            extra["per_layer"] = self._per_layer_inputs(tokens, h)
        out = runner.run(self.layer_pattern, self.stacks, h, (cos, sin, segment_ids, positions), cache=cache,
                         kv_meta=kv_meta, **extra)
        return out._replace(hidden=self.final_norm(out.hidden))

    def _per_layer_inputs(self, tokens, h):
        """Gemma 4's per-layer inputs [L, B, T, P], as transformers' get_per_layer_inputs / project_per_layer_inputs:
        (RMSNorm(reshape(h0 @ W_proj * D^-0.5)) + table[tokens] * sqrt(P)) * 2^-0.5, h0 the scaled embeddings."""
        cfg = self.cfg
        B, T = tokens.shape
        L, P = cfg.num_layers, cfg.per_layer_input_size
        table = jnp.take(on_device(self.embed_per_layer.embedding[...]), tokens, axis=0)  # [B, T, L P]
        table = (table * jnp.asarray(np.float32(P ** 0.5), table.dtype)).astype(self.dtype).reshape(B, T, L, P)
        proj = self.per_layer_model_projection(h) * jnp.asarray(cfg.hidden_size ** -0.5, h.dtype)
        proj = self.per_layer_projection_norm(proj.reshape(B, T, L, P))
        return jnp.moveaxis((proj + table) * jnp.asarray(2.0 ** -0.5, h.dtype), 2, 0)

    def _mrope_tables(self, rope_positions, shape):
        cfg = self.cfg
        if cfg.mrope_section is None:
            raise ValueError(f"{cfg.model_type}: rope_positions [3, B, T] given to a model without a multimodal "
                             "rope (rope_parameters.mrope_section)")
        if tuple(rope_positions.shape) != (3, *shape):
            raise ValueError(f"rope_positions: expected [3, {shape[0]}, {shape[1]}], got "
                             f"{list(rope_positions.shape)}")
        return mrope_cos_sin(rope_positions, cfg.rotary_dim, cfg.rope_theta, cfg.mrope_section, True, self.dtype,
                             inv_freq=inv_freq(cfg))

    def _with_images(self, h, images: ImageInputs):
        """h [B, T, D] with the image tokens' embeddings replaced by the tower's merged rows -> (h, the deepstack
        hook for the layer runner or None)."""
        if self.visual is None:
            raise ValueError(f"{self.cfg.model_type}: images given but the model has no vision tower (its checkpoint "
                             "has no model.visual.* tensors, or the model was built without one)")
        B, T, D = h.shape
        out = self.visual(images.pixel_values, images.grid(), dtype=self.dtype, cudnn=self.vision_cudnn)
        merged, deepstack = out.merged, out.deepstack
        if merged.shape[0] != images.token_index.shape[0]:
            raise ValueError(f"images: {merged.shape[0]} merged rows for {images.token_index.shape[0]} token "
                             "indices (the patch bucket must be the token bucket x spatial_merge_size^2)")
        if not self.train_vision:
            merged, deepstack = jax.lax.stop_gradient((merged, deepstack))
        index = images.token_index
        h = h.reshape(B * T, D).at[index].set(merged.astype(h.dtype), mode="drop").reshape(B, T, D)
        if not deepstack:
            return h, None
        features = jnp.stack(deepstack)  # [K, M, D]: one per deepstack merger
        K = features.shape[0]

        def add(i, h):
            def go(h):
                f = jax.lax.dynamic_index_in_dim(features, jnp.minimum(i, K - 1), keepdims=False).astype(h.dtype)
                return h.reshape(B * T, D).at[index].add(f, mode="drop").reshape(B, T, D)
            return jax.lax.cond(i < K, go, lambda h: h, h)

        return h, add

    def head_weight(self) -> jax.Array:
        """The output projection as [D, V] (the transposed embedding when tied)."""
        if self.lm_head is None:
            return self.embed.embedding[...].T
        return self.lm_head.kernel[...]

    def logits(self, h: jax.Array) -> jax.Array:
        """h [B, T, D] -> logits [B, T, V] in fp32 (accumulated in fp32 from compute-dtype operands); with
        `cfg.final_logit_softcapping` c (Gemma 4) c * tanh(logits / c), as the losses read them.

        A served model whose head is the tied embedding ([V, D]: already the decode GEMV's [N, K] layout) takes the
        decode GEMV for calls of few rows once `head_gemv` is set (surojax.quant.laid_out.decode_weights, serving
        only: the kernel has no gradient): the same fp32 sums of compute-dtype products, one pass over the
        embedding's bytes (a small model's largest weight: Qwen3-0.6B's is 311 MB of its 1.2 GB)."""
        emb = self.embed.embedding[...] if self.head_gemv and self.lm_head is None else None
        rows = int(np.prod(h.shape[:-1]))
        if emb is not None and choose(rows, kernel_settings().decode_gemv.value) == "pallas" \
                and weight_error(*emb.shape, m=rows) is None:
            logits = decode_gemv(h, emb.astype(h.dtype), out_dtype=jnp.float32)
        else:
            w = self.head_weight().astype(h.dtype)
            logits = jnp.einsum("btd,dv->btv", h, w, preferred_element_type=jnp.float32)
        cap = self.cfg.final_logit_softcapping
        return logits if cap is None else jnp.float32(cap) * jnp.tanh(logits / jnp.float32(cap))

    def __call__(self, tokens, positions=None, segment_ids=None, *, cache: KVCache | None = None,
                 images: ImageInputs | None = None, rope_positions=None):
        """Logits [B, T, V] (and the cache when one is given). Defaults: one segment, positions 0..T-1. images /
        rope_positions: a vision-language model's (`hidden_states`)."""
        if positions is None:
            positions = jnp.broadcast_to(jnp.arange(tokens.shape[1], dtype=jnp.int32), tokens.shape)
        if segment_ids is None:
            segment_ids = jnp.ones_like(tokens, dtype=jnp.int32)
        h, cache, _ = self.hidden_states(tokens, positions, segment_ids, cache=cache, images=images,
                                         rope_positions=rope_positions)
        logits = self.logits(h)
        return (logits, cache) if cache is not None else logits
