"""Check that peft loads a LoRA adapter that surojax trained on a MoE model and computes surojax's logits.

Two steps, two environments (surojax has no torch; the reference environment has no jax):

    PYTHONPATH=$PWD /work/main/.venv/bin/python scripts/check_moe_peft_export.py make OUT
        for each fixture (tests/fixtures/models/qwen3_5_moe_text, qwen3_5_moe): LoRA r4 on attention, the DeltaNet
        projections, both expert projections and the shared expert (every A and B random, N(0, 0.05)), the routers
        trained with it (train_router: perturbed by 0.05 N(0, 1), saved as modules_to_save); for gemma4_text_moe
        (the experts of Gemma 4's MoE block: module `experts`), lfm2_moe and lfm2_moe_dense (`feed_forward.experts`):
        LoRA r4 "all-linear" (attention, dense MLPs, both expert projections, the short conv's), no router; writes
        OUT/<name>/adapter/ (save_peft_adapter + add_router_to_adapter) and OUT/<name>/ours.npz (fp32 logits of
        the fixture's tokens2, and the base model's)
    /work/refenv/bin/python scripts/check_moe_peft_export.py check OUT
        transformers loads the fixture (eager attention and experts, fp32), peft.PeftModel.from_pretrained the
        adapter; prints, per fixture, the max abs difference of peft's logits to ours and how far the adapter moved
        the logits (it must have been applied); exit 1 when a difference is above 1e-4.
"""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
FIXTURES = ROOT / "tests" / "fixtures" / "models"
QWEN3_5_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "experts", "shared_expert", "in_proj_qkv", "in_proj_z",
                   "in_proj_b", "in_proj_a", "out_proj"]
# fixture -> (LoRA targets, train the routers too)
CASES = {"qwen3_5_moe_text": (QWEN3_5_TARGETS, True), "qwen3_5_moe": (QWEN3_5_TARGETS, True),
         "gemma4_text_moe": ("all-linear", False), "lfm2_moe": ("all-linear", False),
         "lfm2_moe_dense": ("all-linear", False)}
NAMES = tuple(CASES)


def make(out: Path) -> None:
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from surojax.peft.lora import apply_lora, lora_modules
    from surojax.peft.peft_io import save_peft_adapter
    from surojax.peft.trained_router import add_router_to_adapter, make_router_trainable
    from surojax.weights.hf_checkpoint import load_model

    for name in NAMES:
        d = FIXTURES / name
        tokens = jnp.asarray(np.load(d / "expected.npz")["tokens2"])[None]
        model = load_model(d, dtype=jnp.float32, attention="xla")
        base = np.asarray(model(tokens))
        targets, train_router = CASES[name]
        apply_lora(model, targets=targets, rank=4, alpha=8, rngs=nnx.Rngs(0))
        if train_router:
            make_router_trainable(model, jnp.float32)
        key = jax.random.key(1)
        for mod in lora_modules(model).values():
            for var in (mod.lora_a, mod.lora_b):
                key, sub = jax.random.split(key)
                var.set_value(0.05 * jax.random.normal(sub, var.get_value().shape))
        for stack in model.stacks.values() if train_router else ():
            key, sub = jax.random.split(key)
            k = stack.mlp.router.kernel
            k.set_value(k.get_value() + 0.05 * jax.random.normal(sub, k.get_value().shape))
        ours = np.asarray(model(tokens))
        adapter = save_peft_adapter(model, out / name / "adapter", str(d), overwrite=True)
        if train_router:
            add_router_to_adapter(model, adapter)
        np.savez(out / name / "ours.npz", logits=ours, base=base, tokens=np.asarray(tokens))
        print(name, "adapter written; the adapter moves the logits by", float(np.abs(ours - base).max()))


def check(out: Path) -> int:
    import torch
    import transformers
    from peft import PeftModel

    failed = 0
    for name in NAMES:
        saved = np.load(out / name / "ours.npz")
        model = transformers.AutoModelForImageTextToText if name == "qwen3_5_moe" else \
            transformers.AutoModelForCausalLM
        hf = model.from_pretrained(FIXTURES / name, dtype=torch.float32, attn_implementation="eager",
                                   experts_implementation="eager").eval()
        peft_model = PeftModel.from_pretrained(hf, out / name / "adapter").eval()
        with torch.no_grad():
            theirs = peft_model(torch.from_numpy(saved["tokens"].astype(np.int64))).logits.float().numpy()
        diff = float(np.abs(theirs - saved["logits"]).max())
        moved = float(np.abs(theirs - saved["base"]).max())
        ok = diff <= 1e-4 and moved > 1e-2
        failed += not ok
        print(f"{name}: peft vs surojax max abs diff {diff:.2e}; the adapter moved the logits by {moved:.2e}; "
              f"{'ok' if ok else 'FAILED'}")
    return int(failed > 0)


if __name__ == "__main__":
    mode, folder = sys.argv[1], Path(sys.argv[2])
    if mode == "make":
        make(folder)
    else:
        sys.exit(check(folder))
