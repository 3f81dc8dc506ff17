"""What llama.cpp's own converter writes for LFM2-MoE (the `lfm2moe` GGUF architecture), and llama.cpp's logits on
it: the independent reference of tests/weights/test_gguf_lfm2_moe.py.

Run with the reference environment (torch + transformers), giving the llama.cpp tree that llama-cpp-python 0.3.36
vendors (its sdist; see scripts/make_qwen35_gguf_fixtures.py for building its llama library, needed for the logits):

    PYTHONPATH=<sdist> LLAMA_CPP_LIB_PATH=<build>/bin /work/refenv/bin/python \
        scripts/make_lfm2_moe_gguf_fixtures.py --llama-cpp <sdist>/vendor/llama.cpp

It writes:
    tests/fixtures/models/lfm2_moe_gguf/   a tiny Lfm2MoeForCausalLM made by transformers (seed 0) that llama.cpp runs
        as transformers does: the lfm2_moe fixture's shapes with vocab 512 = the fixture tokenizer's (copied in),
        5 layers [conv, full, conv, conv, full] of which the first is dense (num_dense_layers 1: llama.cpp's
        leading_dense_block_count), 4 experts of width 32 (every expert row quantises to Q8_0), top-2,
        routed_scaling_factor 1 and norm_topk_prob (llama.cpp's lfm2moe graph renormalises and never scales),
        use_expert_bias with the bias 0.5 N(0, 1) and the router N(0, 0.5) (the choice is clear of ties and the bias
        moves it); norms 1 + 0.3 N(0, 1); tied head
    tests/fixtures/gguf/lfm2moe_converter.json   per case "<folder>-<file type>" (f32, f16, q8_0): the converter's
        metadata (general.* and tokenizer.* left out: its tokenizer step is skipped) and per tensor [type, ne shape,
        sha256 of the data]
    tests/fixtures/gguf/logits_lfm2moe_f32.npy   when llama_cpp imports: its logits (logits_all, F32 KV cache) on the
        converter's f32 file of lfm2_moe_gguf (with its tokenizer, pre-tokenizer named qwen2) for PROMPT_IDS
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
ARCH, RUNNABLE, CASES = "lfm2moe", "lfm2_moe_gguf", ("f32", "f16", "q8_0")


def make_model(out: Path) -> None:
    from transformers import Lfm2MoeConfig, Lfm2MoeForCausalLM

    cfg = Lfm2MoeConfig(
        vocab_size=512, hidden_size=32, num_attention_heads=4, num_key_value_heads=2, norm_eps=1e-5,
        max_position_embeddings=256, initializer_range=0.1, intermediate_size=48, moe_intermediate_size=32,
        num_experts=4, num_experts_per_tok=2, conv_bias=False, conv_L_cache=3, tie_word_embeddings=True,
        num_hidden_layers=5, layer_types=["conv", "full_attention", "conv", "conv", "full_attention"],
        num_dense_layers=1, use_expert_bias=True, norm_topk_prob=True, routed_scaling_factor=1.0,
        bos_token_id=None, eos_token_id=None, pad_token_id=None)
    torch.manual_seed(0)
    model = Lfm2MoeForCausalLM(cfg).float().eval()
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in [*model.named_parameters(), *model.named_buffers()]:
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.3 * torch.randn(p.shape, generator=gen))
            elif name.endswith("feed_forward.gate.weight"):
                p.copy_(0.5 * torch.randn(p.shape, generator=gen))
            elif name.endswith("expert_bias"):
                p.copy_(0.5 * torch.randn(p.shape, generator=gen))
    if out.exists():
        shutil.rmtree(out)
    model.save_pretrained(out)
    for f in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy(TOKENIZER / f, out / f)


def convert(llama_cpp: Path, model_dir: Path, outtype: str, out: Path, vocab: bool) -> None:
    """llama.cpp's convert_hf_to_gguf.py in this process; without `vocab` its tokenizer step is a no-op, with it
    the fixture tokenizer is named `qwen2` (as surojax's writer names it; the logits read token ids, no text)."""
    if str(llama_cpp) not in sys.path:
        sys.path[:0] = [str(llama_cpp), str(llama_cpp / "gguf-py")]
    import convert_hf_to_gguf
    from conversion import lfm2

    patch = {"get_vocab_base_pre": lambda self, tokenizer: "qwen2"} if vocab else {"set_vocab": lambda self: None}
    cls = lfm2.LFM2MoeModel
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
        np.save(OUT / f"logits_{ARCH}_f32.npy", np.asarray(llm.scores[:len(PROMPT_IDS)], np.float32))


if __name__ == "__main__":
    main()
