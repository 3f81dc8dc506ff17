"""Live interop with PEFT itself (skipped where torch/transformers/peft are not installed; the golden fixture
in test_peft_golden.py covers the same round trip everywhere): PEFT loads OUR adapter and computes our logits,
and our merged model loads in transformers with PEFT's merged logits."""
from __future__ import annotations

import numpy as np
import pytest
from flax import nnx

from peft_support import FIXTURES, randomize_adapter
from surojax.peft.lora import apply_lora, merge_lora
from surojax.peft.peft_io import save_peft_adapter
from surojax.weights.hf_checkpoint import load_model, save_model

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
PeftModel = pytest.importorskip("peft.peft_model").PeftModel  # not bare "peft": tests/peft is a folder too

TOKENS = np.array([[1, 9, 33, 2, 17, 60, 8, 127, 64, 0], [5, 5, 5, 90, 91, 92, 3, 4, 11, 12]], np.int32)


def _hf(path):
    return transformers.AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager",
                                                             dtype=torch.float32).eval()


def _logits(model) -> np.ndarray:
    with torch.no_grad():
        return model(torch.from_numpy(TOKENS.astype(np.int64))).logits.float().numpy()


@pytest.mark.parametrize("use_rslora", [False, True])
def test_peft_loads_our_adapter(tmp_path, use_rslora):
    model = apply_lora(load_model(FIXTURES / "base"), targets=["q_proj", "v_proj", "o_proj", "up_proj", "down_proj"],
                       rank=8, alpha=16.0, use_rslora=use_rslora, rngs=nnx.Rngs(0))
    randomize_adapter(model, seed=4, scale=0.05)
    ours = np.asarray(model(TOKENS))
    out = save_peft_adapter(model, tmp_path / "adapter", str(FIXTURES / "base"))
    peft_model = PeftModel.from_pretrained(_hf(FIXTURES / "base"), out).eval()
    theirs = _logits(peft_model)
    assert np.abs(theirs - _logits(_hf(FIXTURES / "base"))).max() > 0.05  # the adapter was applied
    np.testing.assert_allclose(ours, theirs, rtol=0, atol=1e-4)  # fp32, different op order than torch

    merged_dir = save_model(merge_lora(model), tmp_path / "merged")
    hf_merged = _logits(_hf(merged_dir))
    np.testing.assert_allclose(hf_merged, _logits(peft_model.merge_and_unload()), rtol=0, atol=1e-4)
    np.testing.assert_allclose(hf_merged, theirs, rtol=0, atol=1e-4)
