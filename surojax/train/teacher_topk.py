"""The distillation teacher, online: a frozen model whose top-K log-probs at every supervised position join the batch.

    teacher = OnlineTeacher.load("Qwen/Qwen3-8B", student_tokenizer, top_k=64, dtype=jnp.bfloat16)
    batch |= teacher.topk(batch)      # + teacher_ids int32 [N, T, K], teacher_logps float32 [N, T, K]

The teacher is any model reference surojax.model_loader loads (HF folder, surojax run, .gguf with its quantised
kernels kept); its weights stay resident and never take a gradient. It must share the student's tokenizer (the same
token -> id map, added tokens included): `check_same_vocabulary` refuses otherwise. Ids the tokenizer does not have
(the padding rows of a vocab_size rounded up, e.g. Qwen2.5-7B's 152,064 over 151,665 tokens) are never chosen.

`teacher_topk` is the pure part: log_softmax over the vocabulary at T = 1 then top-K, chunked over tokens like the LM
loss (logits [C, V] fp32 one chunk at a time). Positions with loss_mask 0 get ids 0 and log-probs 0.
"""
from __future__ import annotations

import dataclasses
import os

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from surojax.data.tokenizer import Tokenizer
from surojax.losses.lm import DEFAULT_CHUNK_TOKENS
from surojax.model_loader import load_model_ref
from surojax.models.decoder import Decoder
from surojax.train.run_spec import TrainSetupError
from surojax.weights.gguf_checkpoint import is_gguf_path, load_gguf_tokenizer
from surojax.weights.model_ref import resolve_model

TEACHER_KEYS = ("teacher_ids", "teacher_logps")  # what a teacher source adds to a batch


def teacher_topk(hidden: jax.Array, head_w: jax.Array, loss_mask: jax.Array, *, k: int, n_tokens: int,
                 chunk: int = DEFAULT_CHUNK_TOKENS) -> tuple[jax.Array, jax.Array]:
    """hidden [B, T, D] (final-normed), head_w [D, V], loss_mask [B, T] -> (ids int32 [B, T, K], log-probs fp32
    [B, T, K] of the full-vocabulary softmax at T = 1, descending). Ids >= n_tokens are excluded (padding rows)."""
    B, T, D = hidden.shape
    n = B * T
    chunk = min(chunk, n)
    pad = -n % chunk
    h = jnp.pad(hidden.reshape(n, D), ((0, pad), (0, 0))).reshape(-1, chunk, D)
    w = head_w.astype(hidden.dtype)

    def one(hc):
        logits = jnp.einsum("cd,dv->cv", hc, w, preferred_element_type=jnp.float32)  # [C, V] fp32
        real = jax.lax.broadcasted_iota(jnp.int32, logits.shape, 1) < n_tokens
        logps = jax.nn.log_softmax(jnp.where(real, logits, -jnp.inf), axis=-1)
        values, ids = jax.lax.top_k(logps, k)  # [C, K]
        return ids.astype(jnp.int32), values

    ids, logps = jax.lax.map(one, h)  # [n_chunks, C, K]
    keep = (loss_mask.reshape(n, 1) > 0)
    ids = jnp.where(keep, ids.reshape(-1, k)[:n], 0).reshape(B, T, k)
    logps = jnp.where(keep, logps.reshape(-1, k)[:n], 0.0).reshape(B, T, k)
    return ids, logps


def teacher_tokenizer(ref: str | os.PathLike) -> Tokenizer:
    """The tokenizer of a teacher reference, without loading its weights (a GGUF's from its metadata)."""
    if is_gguf_path(ref):
        return load_gguf_tokenizer(ref)
    r = resolve_model(ref)
    if r.tokenizer_dir is None:
        return load_gguf_tokenizer(r.weights)
    return Tokenizer.from_dir(r.tokenizer_dir)


def check_same_vocabulary(teacher: Tokenizer, student: Tokenizer, teacher_name: str) -> None:
    """TrainSetupError unless both tokenizers map the same tokens to the same ids (added tokens included)."""
    tv, sv = teacher.backend.get_vocab(with_added_tokens=True), student.backend.get_vocab(with_added_tokens=True)
    if tv == sv:
        return
    differ = sorted(set(tv.items()) ^ set(sv.items()), key=lambda kv: kv[1])[:3]
    raise TrainSetupError(f"teacher: {teacher_name} has a different tokenizer than the student ({len(tv):,} vs "
                          f"{len(sv):,} tokens; e.g. {', '.join(f'{t!r} -> {i}' for t, i in differ)}); distillation "
                          "compares the two models id by id, so they must share the tokenizer")


@dataclasses.dataclass(frozen=True)
class OnlineTeacher:
    """A frozen teacher computing top-K log-probs per batch in this process (one jitted forward per B rows)."""

    name: str
    top_k: int
    rows: int  # rows per teacher forward (the micro-batch)
    forward: object  # jitted (state, tokens, positions, segment_ids, loss_mask) -> (ids, logps)
    state: nnx.State

    @classmethod
    def load(cls, ref: str, student_tokenizer: Tokenizer, *, top_k: int, rows: int, dtype=jnp.bfloat16,
             attention: str = "auto", chunk: int = DEFAULT_CHUNK_TOKENS) -> OnlineTeacher:
        """Load `ref` (weights in `dtype`; a GGUF keeps its quantised kernels) after checking its tokenizer."""
        check_same_vocabulary(teacher_tokenizer(ref), student_tokenizer, ref)
        model = load_model_ref(ref, dtype=dtype, param_dtype=dtype, attention=attention, keep_quantized=True).model
        n_tokens = student_tokenizer.vocab_size
        if n_tokens > model.cfg.vocab_size:
            raise TrainSetupError(f"teacher: {ref} has vocab_size {model.cfg.vocab_size}, fewer than the "
                                  f"tokenizer's {n_tokens} tokens")
        if top_k > n_tokens:
            raise TrainSetupError(f"teacher_top_k: {top_k} exceeds the vocabulary ({n_tokens} tokens)")
        graphdef, state = nnx.split(model)

        @jax.jit
        def forward(state, tokens, positions, segment_ids, loss_mask):
            teacher: Decoder = nnx.merge(graphdef, state)
            h, _ = teacher.hidden_states(tokens, positions, segment_ids)
            return teacher_topk(jax.lax.stop_gradient(h), teacher.head_weight(), loss_mask, k=top_k,
                                n_tokens=n_tokens, chunk=chunk)

        return cls(name=str(ref), top_k=top_k, rows=rows, forward=forward, state=state)

    def topk(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """A host batch [N, T] -> {teacher_ids int32, teacher_logps float32} [N, T, K], `rows` rows per forward
        (a last partial forward is padded with empty rows, so one compiled shape serves every batch)."""
        n = batch["tokens"].shape[0]
        ids, logps = [], []
        for s in range(0, n, self.rows):
            part = [batch[k][s:s + self.rows] for k in ("tokens", "positions", "segment_ids", "loss_mask")]
            short = self.rows - part[0].shape[0]
            if short:
                part = [np.pad(x, [(0, short)] + [(0, 0)] * (x.ndim - 1)) for x in part]
            i, lp = self.forward(self.state, *part)
            ids.append(np.asarray(i)[:self.rows - short])
            logps.append(np.asarray(lp)[:self.rows - short])
        return {"teacher_ids": np.concatenate(ids), "teacher_logps": np.concatenate(logps)}
