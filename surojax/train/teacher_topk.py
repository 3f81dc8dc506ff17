"""The distillation teacher, online: a frozen model whose top-K log-probs at every supervised position join the batch.

    teacher = OnlineTeacher.load("Qwen/Qwen3-8B", student_tokenizer, top_k=64, mesh=mesh, rows=8,
                                 sequence_len=4096, dtype=jnp.bfloat16, admit=check)
    batch |= teacher.topk(batch)      # + teacher_ids int32 [N, T, K], teacher_logps float32 [N, T, K]

The teacher is any model reference surojax.model_loader loads (HF folder, surojax run, .gguf with its quantised
kernels kept); its weights never take a gradient. It must share the student's tokenizer (the same token -> id map,
added tokens included): `check_same_vocabulary` refuses otherwise. Ids the tokenizer does not have (the padding rows
of a vocab_size rounded up, e.g. Qwen2.5-7B's 152,064 over 151,665 tokens) are never chosen.

Placement and memory: the weights are loaded into host memory, counted per device as the run's mesh will hold them
(`placed_bytes` of their shardings by the student's parameter rules: fsdp / tensor splits, quantised kernels at
their packed size) together with the forward's peak (`forward_peak_bytes`), offered to the caller's `admit` (the
trainer adds them to its memory plan and refuses a run that does not fit), and only then placed on the mesh. The
forward is one jit over the mesh; its rows are split over the batch axes like the student's batches.

`teacher_topk` is the pure part: log_softmax over the vocabulary at T = 1 then top-K, in sequence chunks (fp32
logits [B, Tc, V] one chunk at a time). Positions with loss_mask 0 get ids 0 and log-probs 0.
"""
from __future__ import annotations

import dataclasses
import functools
import os
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from surojax.data.tokenizer import Tokenizer
from surojax.losses.lm import DEFAULT_CHUNK_TOKENS, soft_cap
from surojax.model_loader import load_model_ref
from surojax.models.config import ModelConfig
from surojax.models.decoder import Decoder
from surojax.models.layer_runner import Recompute
from surojax.models.layers.attention_backend import AttentionBackend
from surojax.offload.device_budget import Beside, placed_bytes
from surojax.offload.memory_plan import GiB, activation_bytes_per_token_layer, deltanet_layer_bytes
from surojax.offload.streaming import build_context
from surojax.parallel import batch_parallel_size, batch_sharding, param_shardings
from surojax.train.run_spec import TrainSetupError
from surojax.weights.gguf_checkpoint import is_gguf_path, load_gguf_tokenizer
from surojax.weights.model_ref import resolve_model

TEACHER_KEYS = ("teacher_ids", "teacher_logps")  # what a teacher source adds to a batch


def sequence_chunk(rows: int, sequence_len: int, chunk: int) -> int:
    """Positions per chunk of `teacher_topk`: about `chunk` tokens over the `rows` rows, at least 1, at most T."""
    return max(1, min(sequence_len, chunk // max(rows, 1)))


def teacher_topk(hidden: jax.Array, head_w: jax.Array, loss_mask: jax.Array, *, k: int, n_tokens: int,
                 chunk: int = DEFAULT_CHUNK_TOKENS, softcap: float | None = None) -> tuple[jax.Array, jax.Array]:
    """hidden [B, T, D] (final-normed), head_w [D, V], loss_mask [B, T] -> (ids int32 [B, T, K], log-probs fp32
    [B, T, K] of the full-vocabulary softmax at T = 1, descending; the logits soft-capped first when `softcap` is
    set). Ids >= n_tokens are excluded (padding rows).

    Sequence chunks of Tc = `sequence_chunk(B, T, chunk)` positions of every row: the fp32 logits [B, Tc, V] of
    one chunk exist at a time, never [B, T, V], and the rows stay split where the batch sharding put them."""
    B, T, D = hidden.shape
    tc = sequence_chunk(B, T, chunk)
    pad = -T % tc
    h = jnp.pad(hidden, ((0, 0), (0, pad), (0, 0))).reshape(B, -1, tc, D).swapaxes(0, 1)  # [n_chunks, B, Tc, D]
    w = head_w.astype(hidden.dtype)

    def one(hc):
        logits = soft_cap(jnp.einsum("btd,dv->btv", hc, w, preferred_element_type=jnp.float32), softcap)
        real = jax.lax.broadcasted_iota(jnp.int32, logits.shape, 2) < n_tokens
        logps = jax.nn.log_softmax(jnp.where(real, logits, -jnp.inf), axis=-1)
        values, ids = jax.lax.top_k(logps, k)  # [B, Tc, K]
        return ids.astype(jnp.int32), values

    ids, logps = jax.lax.map(one, h)  # [n_chunks, B, Tc, K]
    ids, logps = (x.swapaxes(0, 1).reshape(B, -1, k)[:, :T] for x in (ids, logps))  # [B, T, K]
    keep = loss_mask[..., None] > 0
    return jnp.where(keep, ids, 0), jnp.where(keep, logps, 0.0)


def forward_peak_bytes(cfg: ModelConfig, *, rows: int, device_rows: int, sequence_len: int, chunk: int, top_k: int,
                       compute_bytes: int) -> int:
    """Peak bytes ONE device holds while the teacher's forward runs over `rows` rows (`device_rows` of them on
    this device; T = sequence_len), weights excluded. Nothing is saved for a backward, so the layers' scan keeps:
    the residual stream in and out [device_rows * T, D] x 2 (compute dtype); one layer's intermediates, bounded by
    what that layer would save for its backward without recomputation
    (memory_plan.activation_bytes_per_token_layer, `none`; a hybrid's larger of that and a Gated DeltaNet layer's,
    deltanet_layer_bytes); and then the top-K of one sequence chunk: fp32 logits
    and log-probs [device_rows, Tc, V] x 2, plus the outputs [device_rows, T, K] (int32 ids + fp32 log-probs)."""
    tokens = device_rows * sequence_len
    stream = 2 * tokens * cfg.hidden_size * compute_bytes
    layer = max(tokens * activation_bytes_per_token_layer(cfg, Recompute.NONE, c=compute_bytes),
                deltanet_layer_bytes(cfg, Recompute.NONE, batch=device_rows, seq=sequence_len, c=compute_bytes))
    logits = 2 * device_rows * sequence_chunk(rows, sequence_len, chunk) * cfg.vocab_size * 4
    return stream + max(layer, logits) + tokens * top_k * 8


def teacher_tokenizer(ref: str | os.PathLike) -> Tokenizer:
    """The tokenizer of a teacher reference, without loading its weights (a GGUF's from its metadata)."""
    if is_gguf_path(ref):
        return load_gguf_tokenizer(ref)
    r = resolve_model(ref, weights=False)
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
    """A frozen teacher computing top-K log-probs per batch: its weights placed on the run's mesh by the student's
    parameter rules (surojax.parallel PARAM_RULES: fsdp / tensor splits), one forward jitted over the mesh per
    `rows` rows, split over the batch axes as the student's batches are."""

    name: str
    top_k: int
    rows: int  # this process's rows per teacher forward (the micro-batch's share)
    forward: object  # jitted (state, tokens, positions, segment_ids, loss_mask) [B, T] -> (ids, logps) [B, T, K]
    state: nnx.State  # placed on `mesh`
    mesh: Mesh
    memory: Beside  # bytes per device: weights as placed (resident) + the forward's peak (transient)

    @classmethod
    def load(cls, ref: str, student_tokenizer: Tokenizer, *, top_k: int, mesh: Mesh, rows: int, sequence_len: int,
             dtype=jnp.bfloat16, attention: AttentionBackend | str = "auto", chunk: int = DEFAULT_CHUNK_TOKENS,
             admit: Callable[[Beside], None] | None = None) -> OnlineTeacher:
        """Load `ref` (its tokenizer checked first) in host memory, in `dtype` (a GGUF keeps its quantised kernels),
        count what each device of `mesh` will hold of it (`memory`), let `admit(memory)` refuse it (the run's
        memory check), then place it on `mesh` and compile its forward. rows: the forward's global rows (a
        multiple of the mesh's batch-parallel size); chunk: tokens per chunk of its top-K over those rows."""
        check_same_vocabulary(teacher_tokenizer(ref), student_tokenizer, ref)
        with build_context(True):  # in host memory until it is counted: it may not fit one device whole
            model = load_model_ref(ref, dtype=dtype, param_dtype=dtype, attention=attention, keep_quantized=True).model
        n_tokens = student_tokenizer.vocab_size
        if n_tokens > model.cfg.vocab_size:
            raise TrainSetupError(f"teacher: {ref} has vocab_size {model.cfg.vocab_size}, fewer than the "
                                  f"tokenizer's {n_tokens} tokens")
        if top_k > n_tokens:
            raise TrainSetupError(f"teacher_top_k: {top_k} exceeds the vocabulary ({n_tokens} tokens)")
        dp = batch_parallel_size(mesh)
        if rows % dp:
            raise TrainSetupError(f"teacher: {rows} rows per forward do not split over the mesh's {dp} batch shards")
        cfg = model.cfg
        graphdef, state = nnx.split(model)
        del model
        shardings = param_shardings(state, mesh)
        weights = placed_bytes(state, shardings)
        peak = forward_peak_bytes(cfg, rows=rows, device_rows=rows // dp,
                                  sequence_len=sequence_len, chunk=chunk, top_k=top_k,
                                  compute_bytes=jnp.dtype(dtype).itemsize)
        memory = Beside(f"teacher {ref}", resident=weights, transient=peak,
                        detail=f"weights {weights / GiB:.2f} GiB as placed + forward {peak / GiB:.2f} GiB for "
                               f"{rows // dp} x {sequence_len} tokens",
                        hint="a smaller or quantised teacher, more fsdp devices, or a sidecar (surojax distill "
                             "--precompute, then teacher_logprobs)")
        if admit is not None:
            admit(memory)
        state = jax.device_put(state, shardings)
        rows_out = NamedSharding(mesh, P(*batch_sharding(mesh).spec, None))  # [B, T, K]: rows as the batch

        @functools.partial(jax.jit, out_shardings=(rows_out, rows_out))
        def forward(state, tokens, positions, segment_ids, loss_mask):
            teacher: Decoder = nnx.merge(graphdef, state)
            h = teacher.hidden_states(tokens, positions, segment_ids).hidden
            return teacher_topk(jax.lax.stop_gradient(h), teacher.head_weight(), loss_mask, k=top_k,
                                n_tokens=n_tokens, chunk=chunk, softcap=teacher.cfg.final_logit_softcapping)

        return cls(name=str(ref), top_k=top_k, rows=max(1, rows // jax.process_count()), forward=forward,
                   state=state, mesh=mesh, memory=memory)

    def topk(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """A host batch [N, T] -> {teacher_ids int32, teacher_logps float32} [N, T, K], `rows` rows per forward
        (a last partial forward is padded with empty rows, so one compiled shape serves every batch)."""
        spec = batch_sharding(self.mesh).spec
        n = batch["tokens"].shape[0]
        ids, logps = [], []
        for s in range(0, n, self.rows):
            part = [batch[k][s:s + self.rows] for k in ("tokens", "positions", "segment_ids", "loss_mask")]
            short = self.rows - part[0].shape[0]
            if short:
                part = [np.pad(x, [(0, short)] + [(0, 0)] * (x.ndim - 1)) for x in part]
            part = multihost_utils.host_local_array_to_global_array(part, self.mesh, spec)
            i, lp = multihost_utils.global_array_to_host_local_array(self.forward(self.state, *part), self.mesh,
                                                                     P(*spec, None))
            ids.append(np.asarray(i)[:self.rows - short])
            logps.append(np.asarray(lp)[:self.rows - short])
        return {"teacher_ids": np.concatenate(ids), "teacher_logps": np.concatenate(logps)}

