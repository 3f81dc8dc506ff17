"""A MoE adapter that carries its trained router (PEFT `modules_to_save`) and expert LoRA, per family.

Our export (save_peft_adapter + add_router_to_adapter) reloads through peft_io to the same logits, and -- where the
reference environment exists -- `peft.PeftModel.from_pretrained` over transformers' model of the same fixture
computes the same logits from our folder: the router's saved names (transformers 5's `mlp.gate` even for Mixtral,
whose checkpoints say `block_sparse_moe.gate`; gpt_oss's `mlp.router` with its bias) and the expert LoRA layout
(gpt_oss's experts are `x @ W`-ready [E, D, 2F] with gate / up interleaved; PEFT's ParamWrapper then keeps in / out
unswapped, which is the same lora_A [E*R, D] / lora_B [2F, R*E] layout as the [E, out, in] families).
"""
from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from peft_support import randomize_adapter
from surojax.peft.lora import apply_lora
from surojax.peft.peft_io import AdapterError, load_peft_adapter, save_peft_adapter
from surojax.peft.stacked import load_adapter_into
from surojax.peft.trained_router import add_router_to_adapter, make_router_trainable, peft_router_rows
from surojax.weights.hf_checkpoint import load_model
from surojax.weights.safetensors_file import SafetensorsFile, write_safetensors

MODELS = Path(__file__).resolve().parents[1] / "fixtures" / "models"
REF_PYTHON = Path(os.environ.get("SUROJAX_REF_PYTHON", "/work/refenv/bin/python"))
TOKENS = np.array([[3, 17, 99, 250, 7, 42, 11, 400], [23, 5, 77, 301, 2, 9, 128, 64]], np.int32)  # [B=2, T=8]
ROUTER_MODULE = {"qwen3_moe": "gate", "mixtral": "gate", "gpt_oss": "router"}

# Runs in the reference environment: transformers' model of each base + our adapter through peft -> logits.
PEFT_SCRIPT = """
import sys, numpy as np, torch
from peft import PeftModel
from transformers import AutoModelForCausalLM
for spec in sys.argv[1:]:
    base, adapter, tokens, out = spec.split("=")
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32, attn_implementation="eager")
    model = PeftModel.from_pretrained(model, adapter).eval()
    with torch.no_grad():
        logits = model(input_ids=torch.from_numpy(np.load(tokens))).logits
    np.save(out, logits.numpy())
"""


@nnx.jit
def _logits(model, tokens):
    return model(tokens)


def _adapter_with_router(family: str, out: Path) -> np.ndarray:
    """The fixture model with a random all-linear LoRA (attention + experts) and a perturbed trained router, saved
    to `out` as our trainer saves it. Returns that model's logits on TOKENS."""
    model = load_model(MODELS / family)
    apply_lora(model, targets="all-linear", rank=2, alpha=4, rngs=nnx.Rngs(1))
    randomize_adapter(model)
    make_router_trainable(model, jnp.float32)
    frozen_router = np.asarray(_logits(model, jnp.asarray(TOKENS)))
    router = model.layers.mlp.router
    for i, var in enumerate(v for v in (router.kernel, router.bias) if v is not None):
        noise = jax.random.normal(jax.random.key(10 + i), var.get_value().shape)
        var.set_value(var.get_value() + 0.5 * noise)  # a router change large enough to move the top-k choices
    save_peft_adapter(model, out, MODELS / family)
    add_router_to_adapter(model, out)
    logits = np.asarray(_logits(model, jnp.asarray(TOKENS)))
    assert np.abs(logits - frozen_router).max() > 0.1  # the saved router matters on its own
    return logits


@pytest.fixture(scope="module")
def adapters(tmp_path_factory):
    root = tmp_path_factory.mktemp("router_adapters")
    return {f: (root / f, _adapter_with_router(f, root / f)) for f in ROUTER_MODULE}


@pytest.mark.parametrize("family", list(ROUTER_MODULE))
def test_adapter_with_router_reloads_to_the_same_logits(adapters, family):
    folder, want = adapters[family]
    cfg = json.loads((folder / "adapter_config.json").read_text())
    assert cfg["modules_to_save"] == [ROUTER_MODULE[family]]
    names = SafetensorsFile(folder / "adapter_model.safetensors").names()
    router_names = {n for n in names if f"mlp.{ROUTER_MODULE[family]}." in n}  # transformers 5's module names
    base_model = load_model(MODELS / family)
    assert len(router_names) == (2 if family == "gpt_oss" else 1) * base_model.cfg.num_layers
    # the jitted forward: the folded model has the plain structure again, so both share one compilation
    base = np.asarray(_logits(base_model, jnp.asarray(TOKENS)))
    assert np.abs(want - base).max() > 0.1  # adapter and router matter
    folded = load_adapter_into(load_model(MODELS / family), folder, trainable=False)
    # fp32: x @ (W + s A B) vs x @ W + s (x A) B round differently (4 layers, logits up to ~10)
    np.testing.assert_allclose(np.asarray(_logits(folded, jnp.asarray(TOKENS))), want, rtol=0, atol=1e-4)


def test_modules_to_save_other_than_the_router_are_refused(adapters, tmp_path):
    folder, _ = adapters["qwen3_moe"]
    cfg = json.loads((folder / "adapter_config.json").read_text())
    rows = peft_router_rows(load_model(MODELS / "qwen3_moe").cfg)
    for saved, match in ((["lm_head"], "modules_to_save=\\['lm_head'\\] is not supported"),
                         (["gate", "embed_tokens"], "one saved module"),
                         (["router"], "router module is 'gate': the adapter was trained on another family")):
        bad = tmp_path / "_".join(saved)
        bad.mkdir()
        (bad / "adapter_config.json").write_text(json.dumps(dict(cfg, modules_to_save=saved)))
        (bad / "adapter_model.safetensors").symlink_to(folder / "adapter_model.safetensors")
        with pytest.raises(AdapterError, match=match):
            load_peft_adapter(bad, rows=(), num_layers=2, router_rows=rows)
    with pytest.raises(AdapterError, match="this model has none to load it into"):  # a dense model / no router rows
        load_peft_adapter(folder, num_layers=2)
    (tmp_path / "partial").mkdir()  # a layer's router tensor missing
    f = SafetensorsFile(folder / "adapter_model.safetensors")
    dropped = "base_model.model.model.layers.1.mlp.gate.weight"
    write_safetensors(tmp_path / "partial" / "adapter_model.safetensors",
                      {n: np.asarray(f.get(n)) for n in f.names() if n != dropped})
    (tmp_path / "partial" / "adapter_config.json").write_text(json.dumps(cfg))
    with pytest.raises(AdapterError, match="missing: base_model.model.model.layers.1.mlp.gate.weight"):
        load_peft_adapter(tmp_path / "partial", num_layers=2, router_rows=rows)


@pytest.mark.skipif(not REF_PYTHON.is_file(), reason=f"no reference environment at {REF_PYTHON}")
def test_peft_loads_our_adapter_with_its_router(adapters, tmp_path):
    """peft 0.21 + transformers 5 over the same fixture folders: our export's logits, for every MoE family."""
    np.save(tmp_path / "tokens.npy", TOKENS.astype(np.int64))
    specs = [f"{MODELS / f}={adapters[f][0]}={tmp_path / 'tokens.npy'}={tmp_path / f}.npy" for f in ROUTER_MODULE]
    (tmp_path / "run_peft.py").write_text(PEFT_SCRIPT)
    r = subprocess.run([str(REF_PYTHON), str(tmp_path / "run_peft.py"), *specs], capture_output=True, text=True,
                       timeout=300, env={**os.environ, "TRANSFORMERS_VERBOSITY": "error"})
    assert r.returncode == 0, r.stdout + r.stderr
    for family in ROUTER_MODULE:
        theirs = np.load(tmp_path / f"{family}.npy")
        np.testing.assert_allclose(theirs, adapters[family][1], rtol=0, atol=1e-4, err_msg=family)
