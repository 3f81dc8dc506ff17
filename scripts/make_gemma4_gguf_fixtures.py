"""What llama.cpp's own converter writes for Gemma 4's text model (the `gemma4` GGUF architecture), and llama.cpp's
logits on it: the independent reference of tests/weights/test_gguf_gemma4.py.

Run with the reference environment (torch + transformers), giving the llama.cpp tree that llama-cpp-python 0.3.36
vendors (its sdist; see scripts/make_qwen35_gguf_fixtures.py for building its llama library, needed for the logits):

    PYTHONPATH=<sdist> LLAMA_CPP_LIB_PATH=<build>/bin /work/refenv/bin/python \
        scripts/make_gemma4_gguf_fixtures.py --llama-cpp <sdist>/vendor/llama.cpp

It writes:
    tests/fixtures/models/gemma4_gguf/   a tiny Gemma4ForCausalLM made by transformers (seed 0) with every feature
        llama.cpp's gemma4 graph runs, shaped so that it runs them as transformers does: vocab 512 = the fixture
        tokenizer's (copied in; = vocab_size_per_layer_input), hidden 32, 4 layers [sliding, full] x 2 (sliding_window
        4: the 16-token prompt crosses it), sliding head_dim 16 / 2 kv heads, full layers (per_layer_config, as
        global_head_dim / num_global_key_value_heads give it) head_dim 32 / 1 kv head with attention_k_eq_v (no
        v_proj), their rope proportional with partial_rotary_factor 0.25; per-layer input embeddings of 8; the last
        2 layers KV-shared (llama.cpp reads the keys / values of the last full layer and the sliding layer before it:
        transformers' choice for this pattern) with the double-wide MLP; the MoE block (3 experts of width 32, top-2);
        final_logit_softcapping 30; tied head. Every norm weight 1 + 0.3 N(0, 1) (Gemma 4 multiplies by the weight),
        layer_scalar 1 + 0.3 N(0, 1), router.scale / per_expert_scale 1 + 0.3 N(0, 1), the router N(0, 2) (its
        choice clear of ties)
    tests/fixtures/gguf/gemma4_converter.json   per case "<folder>-<file type>" (f32, f16, q8_0): the converter's
        metadata (general.* and tokenizer.* left out: its tokenizer step is skipped) and per tensor [type, ne shape,
        sha256 of the data]
    tests/fixtures/gguf/logits_gemma4_f32.npy   when llama_cpp imports: its logits (logits_all, F32 KV cache) on the
        converter's f32 file of gemma4_gguf (with the fixture tokenizer written as a gpt2 vocab, pre-tokenizer
        qwen2: the converter's own gemma4 vocab step wants a SentencePiece-style tokenizer; the logits read token
        ids, no text) for PROMPT_IDS; transformers' logits with an f16-rounded GELU (llama.cpp's CPU table) are checked
        to be within 1e-4 of them
Deterministic: a re-run rewrites the same bytes.
"""
from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import make_qwen35_gguf_fixtures as q35  # noqa: E402  (describe, the paths, the prompt)

MODELS, OUT, TOKENIZER, PROMPT_IDS = q35.MODELS, q35.OUT, q35.TOKENIZER, q35.PROMPT_IDS
ARCH, RUNNABLE, CASES = "gemma4", "gemma4_gguf", ("f32", "f16", "q8_0")


def make_model(out: Path) -> None:
    from transformers import Gemma4ForCausalLM, Gemma4TextConfig

    cfg = Gemma4TextConfig(
        vocab_size=512, vocab_size_per_layer_input=512, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, global_head_dim=32, num_global_key_value_heads=1,
        attention_k_eq_v=True, sliding_window=4, max_position_embeddings=256, rms_norm_eps=1e-6,
        initializer_range=0.08, layer_types=["sliding_attention", "full_attention"] * 2,
        rope_parameters={"full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25,
                                            "rope_theta": 1e6},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}},
        hidden_size_per_layer_input=8, num_kv_shared_layers=2, use_double_wide_mlp=True, enable_moe_block=True,
        num_experts=3, top_k_experts=2, moe_intermediate_size=32, final_logit_softcapping=30.0,
        tie_word_embeddings=True, bos_token_id=None, eos_token_id=None, pad_token_id=None)
    torch.manual_seed(0)
    model = Gemma4ForCausalLM(cfg).float().eval()
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in [*model.named_parameters(), *model.named_buffers()]:
            if name.endswith(("norm.weight", "layer_scalar", "router.scale", "per_expert_scale")):
                p.copy_(1 + 0.3 * torch.randn(p.shape, generator=gen))
            elif name.endswith("router.proj.weight"):
                p.copy_(2.0 * torch.randn(p.shape, generator=gen))
    if out.exists():
        shutil.rmtree(out)
    model.save_pretrained(out)
    for f in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy(TOKENIZER / f, out / f)


def convert(llama_cpp: Path, model_dir: Path, outtype: str, out: Path, vocab: bool) -> None:
    """llama.cpp's convert_hf_to_gguf.py in this process; without `vocab` its tokenizer step is a no-op, with it
    the fixture tokenizer is written as a gpt2 vocab named `qwen2` (as surojax's writer names it)."""
    if str(llama_cpp) not in sys.path:
        sys.path[:0] = [str(llama_cpp), str(llama_cpp / "gguf-py")]
    import convert_hf_to_gguf
    from conversion import gemma

    cls = gemma.Gemma4Model
    if vocab:
        patch = {"get_vocab_base_pre": lambda self, tokenizer: "qwen2",
                 "set_vocab": lambda self: self._set_vocab_gpt2()}
    else:
        patch = {"set_vocab": lambda self: None}
    saved = {n: cls.__dict__.get(n) for n in patch}
    for name, fn in patch.items():
        setattr(cls, name, fn)
    argv = sys.argv
    sys.argv = ["convert_hf_to_gguf.py", str(model_dir), "--outfile", str(out), "--outtype", outtype]
    try:
        convert_hf_to_gguf.main()
    finally:
        sys.argv = argv
        for name, fn in saved.items():
            if fn is None:
                delattr(cls, name)
            else:
                setattr(cls, name, fn)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--llama-cpp", type=Path, required=True, help="llama-cpp-python 0.3.36's vendor/llama.cpp")
    args = ap.parse_args()
    make_model(MODELS / RUNNABLE)
    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        for outtype in CASES:
            path = Path(tmp) / f"{RUNNABLE}-{outtype}.gguf"
            convert(args.llama_cpp, MODELS / RUNNABLE, outtype, path, vocab=False)
            d = q35.describe(path)
            del d["ssm_a"]
            out[f"{RUNNABLE}-{outtype}"] = d
        (OUT / f"{ARCH}_converter.json").write_text(json.dumps(out, indent=1, sort_keys=True) + "\n")
        try:
            import llama_cpp
        except ImportError:
            print(f"llama_cpp is not importable: logits_{ARCH}_f32.npy not written")
            return
        path = Path(tmp) / "with-vocab.gguf"
        convert(args.llama_cpp, MODELS / RUNNABLE, "f32", path, vocab=True)
        # an F32 KV cache (type 0): llama.cpp's default F16 cache alone moves the logits by ~1e-3
        llm = llama_cpp.Llama(str(path), n_ctx=64, logits_all=True, verbose=False, n_threads=2, type_k=0, type_v=0)
        llm.eval(PROMPT_IDS)
        ref = np.asarray(llm.scores[:len(PROMPT_IDS)], np.float32)
        np.save(OUT / f"logits_{ARCH}_f32.npy", ref)
        check_f16_gelu(MODELS / RUNNABLE, ref)


def check_f16_gelu(folder: Path, ref: np.ndarray) -> None:
    """transformers' logits are ~1.6e-3 from llama.cpp's; with its GELU taken on f16-rounded inputs and outputs (what
    llama.cpp's CPU GELU table does) they come within 1e-4: the difference is that table, not the graph."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        exact = model(torch.tensor([PROMPT_IDS])).logits[0].numpy()

    class F16Gelu(torch.nn.Module):
        def forward(self, x):
            return torch.nn.functional.gelu(x.half().float(), approximate="tanh").half().float()

    for module in list(model.modules()):
        if isinstance(getattr(module, "act_fn", None), torch.nn.Module):
            module.act_fn = F16Gelu()
    with torch.no_grad():
        rounded = model(torch.tensor([PROMPT_IDS])).logits[0].numpy()
    print(f"|transformers - llama.cpp| {np.abs(exact - ref).max():.2e}, with an f16 GELU "
          f"{np.abs(rounded - ref).max():.2e}")
    assert np.abs(rounded - ref).max() < 1e-4


if __name__ == "__main__":
    main()
