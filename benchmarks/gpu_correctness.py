"""Correctness on the GPU, before any speed figure counts: prints a table and one `RESULT {json}` line.

    python benchmarks/gpu_correctness.py               # on the H200 (cuDNN + HF transformers on CUDA)
    python benchmarks/gpu_correctness.py --cpu-smoke   # tiny shapes on the CPU, no cuDNN (any machine)

(a) attention: the cudnn backend (`cudnn_packed_attention`, the branch it takes is checked: packed, plain
    causal or fallback) against the xla backend on random packed bf16 inputs of Qwen3-0.6B's attention
    shape (B4 T2048 N16 K8 H128), forward and gradients of sum(out * g) over the real tokens. Both are
    measured against the fp32 truth (xla on fp32 copies, HIGHEST matmul precision):
        pass  rel(cudnn, truth) <= 2 * rel(xla_bf16, truth) + 2e-3      (out, dq, dk, dv each)
    rel(a, b) = ||a - b|| / ||b|| over real tokens (Frobenius, fp32). Padding positions are excluded: no
    real token reads them (the attention module's docstring says why they differ).
(b) training: the first 5 losses of OUR training step (surojax.bench.train_bench.build: the trainer's model
    build, lm_loss, adamw + clipping) against HF transformers on the same weights (converted with
    `hf_tensors`) and the same packed batch (HF runs each packed sequence as its own right-padded row, the
    unpacked computation packing must equal). AdamW (betas 0.9/0.999, eps 1e-8, no weight decay) + global
    norm clipping at 1.0 on both sides; a Qwen3 with 0.6B's widths and vocabulary (151,936) and 4 layers;
    full fine-tune (lr 5e-4) and LoRA r16 on all 7 targets (lr 2e-3; our adapter, A random and B = 0,
    loaded into PEFT as a PEFT folder written by save_peft_adapter). Recipes:
        fp32  ours fp32 (HIGHEST matmul precision, no TF32) vs HF fp32 eager:     max |dloss| <= 1e-3
        bf16  ours bf16 recipe (bf16 compute, cuDNN packed attention; full: fp32 master weights, LoRA: bf16
              base + fp32 adapters) vs HF on the same stored weights under torch.autocast(bf16), eager:
                                                                                 max |dloss| <= 2e-2
    (--cpu-smoke, tiny model: fp32 ~1e-5, bf16 ~5e-3). The check is only meaningful if the loss moves:
    loss[0] - loss[4] must exceed 5x the tolerance (raise --lr / --lora-lr if it does not).
(c) timing of attention alone (GPU only): fwd+bwd of cudnn dense / packed at several M / xla, B8 T2048.

Exit code 1 if any check fails.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # torch shares the GPU with JAX here
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from surojax.models.layers import attention as att  # noqa: E402

ROWS: list[dict] = []


def row(part: str, case: str, ok: bool | None, **fields) -> None:
    ROWS.append({"part": part, "case": case, "ok": ok, **fields})
    shown = " ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}" for k, v in fields.items())
    status = "PASS" if ok else ("FAIL" if ok is not None else "info")
    print(f"[{status}] {part:9s} {case:28s} {shown}", flush=True)


# ---- (a) attention: cudnn vs xla ----------------------------------------------------------------------------

def packed_ids(rng, B, T, nseg, pad_max, M_overflow_row=None):
    seg = np.zeros((B, T), np.int32)
    pos = np.zeros((B, T), np.int32)
    for b in range(B):
        n = nseg if M_overflow_row is None or b != 0 else M_overflow_row
        end = T - (int(rng.integers(1, pad_max)) if pad_max > 1 else 0)
        cuts = np.sort(rng.choice(np.arange(1, end), size=n - 1, replace=False)) if n > 1 else np.zeros(0, int)
        bounds = [0, *cuts.tolist(), end]
        for i in range(n):
            seg[b, bounds[i]:bounds[i + 1]] = i + 1
            pos[b, bounds[i]:bounds[i + 1]] = np.arange(bounds[i + 1] - bounds[i])
    return jnp.asarray(seg), jnp.asarray(pos)


def rel(a, b, real):
    w = real[:, :, None, None]
    a, b = a.astype(jnp.float32) * w, b.astype(jnp.float32) * w
    return float(jnp.linalg.norm((a - b).ravel()) / jnp.maximum(jnp.linalg.norm(b.ravel()), 1e-30))


def attention_case(name, seg, pos, *, M, window=None, expect_branch, N=16, K=8, H=128, seed=0):
    B, T = seg.shape
    k1, k2, k3, k4 = jax.random.split(jax.random.key(seed), 4)
    q = jax.random.normal(k1, (B, T, N, H), jnp.bfloat16)
    k = jax.random.normal(k2, (B, T, K, H), jnp.bfloat16)
    v = jax.random.normal(k3, (B, T, K, H), jnp.bfloat16)
    g = jax.random.normal(k4, (B, T, N, H), jnp.float32)
    real = (seg > 0).astype(jnp.float32)
    scale = H ** -0.5
    mask = att.attention_mask(seg, seg, pos, pos, window)

    def run(fn, *xs):
        # every array is an argument: closed-over arrays become constants that XLA folds for minutes
        def f(q, k, v, g, real, mask, seg, pos):
            out = fn(q, k, v, mask, seg, pos)
            return jnp.sum(out.astype(jnp.float32) * g * real[:, :, None, None]), out
        (_, out), grads = jax.jit(jax.value_and_grad(f, argnums=(0, 1, 2), has_aux=True))(
            *xs, g, real, mask, seg, pos)
        return (out, *grads)

    with jax.default_matmul_precision("highest"):
        truth = run(lambda q, k, v, mask, seg, pos: att.xla_attention(q, k, v, mask, scale),
                    q.astype(jnp.float32), k.astype(jnp.float32), v.astype(jnp.float32))
    xla = run(lambda q, k, v, mask, seg, pos: att.xla_attention(q, k, v, mask, scale), q, k, v)
    cud = run(lambda q, k, v, mask, seg, pos: att.cudnn_packed_attention(
        q, k, v, seg, pos, scale, sliding_window=window, max_segments=M), q, k, v)
    branch = int(att.cudnn_branch(seg, pos, M))
    ok = branch == expect_branch
    fields = {"branch": branch}
    for label, a, b, t in zip(("out", "dq", "dk", "dv"), cud, xla, truth):
        e_c, e_x = rel(a, t, real), rel(b, t, real)
        fields[f"{label}_cudnn"] = e_c
        fields[f"{label}_xla"] = e_x
        fields[f"{label}_vs_xla"] = rel(a, b, real)
        ok &= bool(np.isfinite(e_c)) and e_c <= 2 * e_x + 2e-3
    row("attention", name, ok, **fields)


def guarded(part, case, fn, *args, **kwargs):
    """Run one case; an exception is a FAIL row with its message, and the other cases still run."""
    try:
        fn(*args, **kwargs)
    except Exception as e:  # noqa: BLE001 - report and go on
        row(part, case, False, error=f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}")


def part_attention():
    rng = np.random.default_rng(0)
    B, T = 4, 2048
    seg, pos = packed_ids(rng, B, T, nseg=6, pad_max=200)
    one, opos = packed_ids(rng, B, T, nseg=1, pad_max=1)
    over, opos2 = packed_ids(rng, B, T, nseg=6, pad_max=200, M_overflow_row=20)
    cases = [
        ("packed 6 seg + pad, M=16", seg, pos, dict(M=16, expect_branch=1)),
        ("packed 6 seg + pad, M=7", seg, pos, dict(M=7, expect_branch=1)),  # every slot used
        ("packed, window 256", seg, pos, dict(M=16, window=256, expect_branch=1)),
        ("one segment per row", one, opos, dict(M=16, expect_branch=0)),
        ("one segment, window 256", one, opos, dict(M=16, window=256, expect_branch=0)),
        ("20 seg in a row > M=16", over, opos2, dict(M=16, expect_branch=2)),
    ]
    for name, s, p, kw in cases:
        guarded("attention", name, attention_case, name, s, p, **kw)


def part_attention_timing(reps: int = 20):
    """fwd+bwd time of attention alone, B8 T2048 N16 K8 H128, 4 packed segments per row (+ dense rows)."""
    rng = np.random.default_rng(1)
    B, T, N, K, H = 8, 2048, 16, 8, 128
    seg, pos = packed_ids(rng, B, T, nseg=4, pad_max=1)
    one, opos = packed_ids(rng, B, T, nseg=1, pad_max=1)
    k1, k2, k3 = jax.random.split(jax.random.key(1), 3)
    q = jax.random.normal(k1, (B, T, N, H), jnp.bfloat16)
    k = jax.random.normal(k2, (B, T, K, H), jnp.bfloat16)
    v = jax.random.normal(k3, (B, T, K, H), jnp.bfloat16)

    def timed(name, fn):
        guarded("timing", name, _timed, name, fn)

    def _timed(name, fn):
        f = jax.jit(jax.grad(lambda q, k, v: jnp.sum(fn(q, k, v).astype(jnp.float32)), argnums=(0, 1, 2)))
        jax.block_until_ready(f(q, k, v))
        t0 = time.perf_counter()
        for _ in range(reps):
            out = f(q, k, v)
        jax.block_until_ready(out)
        row("timing", name, None, ms=(time.perf_counter() - t0) / reps * 1e3)

    s = H ** -0.5
    timed("xla, 4 seg/row", lambda q, k, v: att.xla_attention(q, k, v, att.attention_mask(seg, seg, pos, pos), s))
    timed("cudnn dense rows (branch 0)", lambda q, k, v: att.cudnn_packed_attention(q, k, v, one, opos, s))
    for M in (4, 8, 16, 32, 64):
        timed(f"cudnn packed M={M}", lambda q, k, v, M=M: att.cudnn_packed_attention(q, k, v, seg, pos, s,
                                                                                   max_segments=M))
    timed("cudnn packed M=16 nocheck", lambda q, k, v: att.cudnn_packed_attention(q, k, v, seg, pos, s,
                                                                               max_segments=16, check=False))


# ---- (b) training losses: ours vs HF transformers -----------------------------------------------------------

def packed_batch(rng, B, T, vocab, nseg, pad):
    """One micro-batch [1, B, T] with nseg sequences per row then `pad` padding tokens; and the sequences."""
    seg, pos = np.zeros((B, T), np.int32), np.zeros((B, T), np.int32)
    tok = np.zeros((B, T), np.int32)
    tgt, mask = np.zeros((B, T), np.int32), np.zeros((B, T), np.float32)
    seqs = []
    for b in range(B):
        end = T - pad
        cuts = np.sort(rng.choice(np.arange(8, end - 8), size=nseg - 1, replace=False))
        bounds = [0, *cuts.tolist(), end]
        for i in range(nseg):
            a, e = bounds[i], bounds[i + 1]
            ids = rng.integers(1, vocab, size=e - a).astype(np.int32)
            tok[b, a:e], seg[b, a:e], pos[b, a:e] = ids, i + 1, np.arange(e - a)
            tgt[b, a:e - 1], mask[b, a:e - 1] = ids[1:], 1.0
            seqs.append(ids)
    batch = {"tokens": tok, "positions": pos, "segment_ids": seg, "targets": tgt, "loss_mask": mask}
    return {k: v[None] for k, v in batch.items()}, seqs


def hf_losses(model_cfg, tensors, seqs, *, steps, lr, bf16, device, adapter_dir=None):
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    hf = model_cfg.to_hf()
    cfg = AutoConfig.for_model(hf.pop("model_type"), **hf)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="eager", dtype=torch.float32).to(device)
    state = {k: torch.from_numpy(np.ascontiguousarray(v, np.float32)) for k, v in tensors.items()}
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
    model.tie_weights()
    if adapter_dir is not None:  # LoRA: our adapter (A random, B = 0) as a PEFT folder, trainable
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, adapter_dir, is_trainable=True)
    model.train()
    L = max(len(s) for s in seqs)
    ids = torch.zeros((len(seqs), L), dtype=torch.long)
    am = torch.zeros((len(seqs), L), dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, :len(s)] = torch.from_numpy(s.astype(np.int64))
        am[i, :len(s)] = 1
    ids, am = ids.to(device), am.to(device)
    labels = ids[:, 1:]
    lmask = (am[:, 1:] * am[:, :-1]).float()  # target t+1 exists inside the same sequence
    params = [q for q in model.parameters() if q.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)
    losses = []
    for _ in range(steps):
        with torch.autocast(device_type=device.type, dtype=torch.bfloat16, enabled=bf16):
            logits = model(input_ids=ids, attention_mask=am).logits
        logp = torch.log_softmax(logits[:, :-1].float(), dim=-1)
        nll = -logp.gather(-1, labels[..., None])[..., 0]
        loss = (nll * lmask).sum() / lmask.sum()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


def our_losses(shape, recipe, mode, batch, *, steps, lr, adapter_dir):
    """Our step's losses, and the initial weights as HF tensors (+ the adapter as a PEFT folder for LoRA)."""
    from flax import nnx

    from surojax.bench.train_bench import BenchConfig, build, place_batch
    from surojax.peft.lora import merge_lora
    from surojax.peft.peft_io import save_peft_adapter
    from surojax.weights.hf_checkpoint import hf_tensors

    B, T = batch["tokens"].shape[1:]
    bc = BenchConfig(shape=shape, mode=mode, batch=B, seq=T, recipe=recipe, learning_rate=lr, seed=0, min_segment=1,
                     unroll_layers=OPTIONS["unroll_layers"])
    setup = build(bc)
    model = nnx.merge(setup.graphdef, setup.trainable, setup.frozen)
    if mode == "lora":
        save_peft_adapter(model, adapter_dir, None, dtype=np.float32)
        model = merge_lora(model)  # B = 0: the base weights unchanged, as a plain model for hf_tensors
    tensors = hf_tensors(model, np.float32)
    dev_batch = place_batch(setup, batch)
    tr, opt, key = setup.trainable, setup.opt_state, jax.random.key(0)
    losses = []
    for _ in range(steps):
        tr, opt, m = setup.train_step(tr, setup.frozen, opt, dev_batch, key)
        losses.append(float(m["loss"]))
    return losses, tensors, setup.model_config


TOLERANCE = {"fp32": 1e-3, "bf16": 2e-2}
OPTIONS = {"unroll_layers": 1, "recipes": ("fp32", "bf16")}  # set from the command line
SENSITIVITY = 5  # the loss must move by more than this many tolerances over the steps


def part_training(shape, B, T, nseg, pad, *, steps, lr, lora_lr, device, modes=("full", "lora")):
    rng = np.random.default_rng(0)
    from surojax.bench.shapes import model_config

    batch, seqs = packed_batch(rng, B, T, model_config(shape).vocab_size, nseg, pad)
    try:
        import peft  # noqa: F401
    except ImportError:
        if "lora" in modes:
            row("training", "lora vs HF+PEFT", None, skipped="peft is not installed")
        modes = tuple(m for m in modes if m != "lora")
    for mode in modes:
        for recipe in OPTIONS["recipes"]:
            guarded("training", f"{shape} {mode} {recipe}", training_case, shape, mode, recipe, batch, seqs,
                    steps=steps, lr=lr if mode == "full" else lora_lr, device=device)


def part_ours_only(shape, *, steps, lr):
    """Without torch: our bf16 recipe against our fp32 recipe on the same packed batch (full fine-tune)."""
    from surojax.bench.shapes import model_config

    batch, _ = packed_batch(np.random.default_rng(0), 2, 64 if shape == "debug" else 2048,
                            model_config(shape).vocab_size, 3, 5)
    with jax.default_matmul_precision("highest"):
        f32 = our_losses(shape, "fp32", "full", batch, steps=steps, lr=lr, adapter_dir=None)[0]
    b16 = our_losses(shape, "bf16", "full", batch, steps=steps, lr=lr, adapter_dir=None)[0]
    diff = max(abs(a - b) for a, b in zip(f32, b16))
    tol = TOLERANCE["bf16"]
    ok = diff <= tol and f32[0] - f32[-1] > SENSITIVITY * tol and all(np.isfinite(b16))
    row("training", f"{shape} full bf16 vs fp32 (ours)", ok, max_abs_diff=diff, tol=tol, loss_drop=f32[0] - f32[-1],
        fp32=" ".join(f"{x:.5f}" for x in f32), bf16=" ".join(f"{x:.5f}" for x in b16))


def training_case(shape, mode, recipe, batch, seqs, *, steps, lr, device):
    tol = TOLERANCE[recipe]
    t0 = time.perf_counter()
    if recipe == "fp32":
        import torch

        torch.set_float32_matmul_precision("highest")  # no TF32 on the HF side either
    with tempfile.TemporaryDirectory() as tmp, jax.default_matmul_precision(
            "highest" if recipe == "fp32" else "default"):
        adapter = Path(tmp) / "adapter" if mode == "lora" else None
        ours, tensors, mcfg = our_losses(shape, recipe, mode, batch, steps=steps, lr=lr, adapter_dir=adapter)
        theirs = hf_losses(mcfg, tensors, seqs, steps=steps, lr=lr, bf16=recipe == "bf16", device=device,
                           adapter_dir=adapter)
    diff = max(abs(a - b) for a, b in zip(ours, theirs))
    moved = ours[0] - ours[-1]
    ok = diff <= tol and moved > SENSITIVITY * tol and all(np.isfinite(ours))
    row("training", f"{shape} {mode} {recipe}", ok, max_abs_diff=diff, tol=tol, loss_drop=moved, lr=lr,
        seconds=time.perf_counter() - t0,
        ours=" ".join(f"{x:.5f}" for x in ours), hf=" ".join(f"{x:.5f}" for x in theirs))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cpu-smoke", action="store_true", help="tiny shapes on the CPU; skips cuDNN")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--lr", type=float, default=5e-4, help="full fine-tune learning rate")
    p.add_argument("--lora-lr", type=float, default=2e-3, help="LoRA learning rate")
    p.add_argument("--skip-timing", action="store_true", help="skip (c), the attention timing")
    p.add_argument("--modes", type=lambda v: tuple(v.split(",")), default=("full", "lora"),
                   help="training checks to run: full,lora (default both)")
    p.add_argument("--recipes", type=lambda v: tuple(v.split(",")), default=("fp32", "bf16"),
                   help="training recipes to check: fp32,bf16 (default both)")
    p.add_argument("--unroll-layers", default="1", help="our step's layer loop: 1 (rolled) or all (inlined)")
    p.add_argument("--skip-attention", action="store_true", help="skip (a), the attention checks")
    a = p.parse_args()
    OPTIONS.update(unroll_layers=True if a.unroll_layers == "all" else int(a.unroll_layers), recipes=a.recipes)
    t0 = time.perf_counter()
    gpu = jax.default_backend() == "gpu" and not a.cpu_smoke
    print(f"devices: {jax.devices()}; jax {jax.__version__}", flush=True)
    if gpu and not a.skip_attention:
        part_attention()
        if not a.skip_timing:
            part_attention_timing()
    else:
        row("attention", "cuDNN cases", None, skipped="no GPU (--cpu-smoke)")
    try:
        import torch
    except ImportError:
        torch = None
    if torch is None:
        row("training", "vs HF transformers", None, skipped="torch is not installed")
        guarded("training", "ours bf16 vs ours fp32", part_ours_only, "qwen3-small" if gpu else "debug",
                steps=a.steps, lr=a.lr * (1 if gpu else 10))
    elif gpu:
        part_training("qwen3-small", B=2, T=2048, nseg=3, pad=100, steps=a.steps, lr=a.lr, lora_lr=a.lora_lr,
                      device=torch.device("cuda"), modes=a.modes)
    else:
        part_training("debug", B=2, T=64, nseg=3, pad=5, steps=a.steps, lr=a.lr * 10, lora_lr=a.lora_lr * 5,
                      device=torch.device("cpu"), modes=a.modes)
    failed = [r for r in ROWS if r["ok"] is False]
    print("RESULT " + json.dumps({"impl": "gpu_correctness", "ok": not failed, "failed": [r["case"] for r in failed],
                                  "rows": ROWS, "seconds": time.perf_counter() - t0}), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
