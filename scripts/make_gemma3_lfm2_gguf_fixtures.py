"""What llama.cpp's own converter writes for Gemma 3 (the `gemma3` GGUF architecture) and LFM2 (`lfm2`), and
llama.cpp's logits on it: the independent reference of tests/weights/test_gguf_gemma3_lfm2.py.

Run with the reference environment (torch + transformers), giving the llama.cpp tree that llama-cpp-python 0.3.36
vendors (its sdist; see scripts/make_qwen35_gguf_fixtures.py for building its llama library, needed for the logits):

    PYTHONPATH=<sdist> LLAMA_CPP_LIB_PATH=<build>/bin /work/refenv/bin/python \
        scripts/make_gemma3_lfm2_gguf_fixtures.py --llama-cpp <sdist>/vendor/llama.cpp

It writes:
    tests/fixtures/models/gemma3_gguf/   a tiny Gemma3ForCausalLM made by transformers (seed 0) that llama.cpp runs
        as transformers does: vocab 512 = the fixture tokenizer's (copied in; the converter trims token_embd to the
        tokenizer's 507 + 5 added tokens, all of them), 6 layers in llama.cpp's default pattern (5 sliding, 1 full),
        sliding_window 4 (the 16-token prompt crosses it), query_pre_attn_scalar = head_dim 16 (llama.cpp's
        attention scale), sliding layers' rope theta 10000 (llama.cpp's fixed local base), the full layer's rope
        theta 1e6 with linear scaling 8; tied head; every (1 + w) norm 0.3 N(0, 1)
    tests/fixtures/models/lfm2_gguf/   a tiny Lfm2ForCausalLM (seed 0; the lfm2 fixture's shapes with vocab 512 and
        the tokenizer; norms 1 + 0.3 N(0, 1))
    tests/fixtures/gguf/<arch>_converter.json   per case "<folder>-<file type>": the converter's metadata (general.*
        and tokenizer.* left out: its tokenizer step is skipped) and per tensor [type, ne shape, sha256 of the data]
    tests/fixtures/gguf/logits_<arch>_f32.npy   when llama_cpp imports: its logits (logits_all) on the converter's
        f32 file of the runnable folder (with its tokenizer, pre-tokenizer named qwen2) for PROMPT_IDS
Deterministic: a re-run rewrites the same bytes.
"""
from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import make_qwen35_gguf_fixtures as q35  # noqa: E402  (describe, the paths, the prompt)

MODELS, OUT, TOKENIZER, PROMPT_IDS = q35.MODELS, q35.OUT, q35.TOKENIZER, q35.PROMPT_IDS
# (arch, the llama.cpp-runnable folder, [(folder, file type)])
SETS = (("gemma3", "gemma3_gguf", (("gemma3_gguf", "f32"), ("gemma3_gguf", "f16"), ("gemma3_gguf", "q8_0"))),
        ("lfm2", "lfm2_gguf", (("lfm2_gguf", "f32"), ("lfm2_gguf", "f16"), ("lfm2_gguf", "q8_0"),
                               ("lfm2", "f32"))))


def make_model(arch: str, out: Path) -> None:
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig, Lfm2Config, Lfm2ForCausalLM

    if arch == "gemma3":
        cfg = Gemma3TextConfig(
            vocab_size=512, hidden_size=32, intermediate_size=64, num_hidden_layers=6, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=16, sliding_window=4,
            max_position_embeddings=256, rms_norm_eps=1e-6, initializer_range=0.08, tie_word_embeddings=True,
            layer_types=["sliding_attention"] * 5 + ["full_attention"],
            rope_parameters={"full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
                             "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}},
            bos_token_id=None, eos_token_id=None, pad_token_id=None)
        cls, shift = Gemma3ForCausalLM, 0.0
    else:
        cfg = Lfm2Config(**{**__import__("json").loads((MODELS / "lfm2" / "config.json").read_text()),
                            "vocab_size": 512, "bos_token_id": None, "eos_token_id": None, "pad_token_id": None})
        cls, shift = Lfm2ForCausalLM, 1.0
    torch.manual_seed(0)
    model = cls(cfg).float().eval()
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(shift + 0.3 * torch.randn(p.shape, generator=gen))
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
    from conversion import gemma, lfm2

    patch = {"get_vocab_base_pre": lambda self, tokenizer: "qwen2"} if vocab else {"set_vocab": lambda self: None}
    classes = (gemma.Gemma3Model, lfm2.LFM2Model)
    saved = {(c, n): c.__dict__.get(n) for c in classes for n in patch}
    for c in classes:
        for name, fn in patch.items():
            setattr(c, name, fn)
    argv = sys.argv
    sys.argv = ["convert_hf_to_gguf.py", str(model_dir), "--outfile", str(out), "--outtype", outtype]
    try:
        convert_hf_to_gguf.main()
    finally:
        sys.argv = argv
        for (c, name), fn in saved.items():
            if fn is None:
                delattr(c, name)
            else:
                setattr(c, name, fn)


def main() -> None:
    import json

    import numpy as np

    ap = argparse.ArgumentParser()
    ap.add_argument("--llama-cpp", type=Path, required=True, help="llama-cpp-python 0.3.36's vendor/llama.cpp")
    args = ap.parse_args()
    for arch, runnable, cases in SETS:
        make_model(arch, MODELS / runnable)
        out = {}
        with tempfile.TemporaryDirectory() as tmp:
            for folder, outtype in cases:
                path = Path(tmp) / f"{folder}-{outtype}.gguf"
                convert(args.llama_cpp, MODELS / folder, outtype, path, vocab=False)
                d = q35.describe(path)
                del d["ssm_a"]
                out[f"{folder}-{outtype}"] = d
            (OUT / f"{arch}_converter.json").write_text(json.dumps(out, indent=1, sort_keys=True) + "\n")
            try:
                import llama_cpp
            except ImportError:
                print(f"llama_cpp is not importable: logits_{arch}_f32.npy not written")
                continue
            path = Path(tmp) / "with-vocab.gguf"
            convert(args.llama_cpp, MODELS / runnable, "f32", path, vocab=True)
            # an F32 KV cache (type 0): llama.cpp's default F16 cache alone moves the logits by ~1e-3
            llm = llama_cpp.Llama(str(path), n_ctx=64, logits_all=True, verbose=False, n_threads=2, type_k=0,
                                  type_v=0)
            llm.eval(PROMPT_IDS)
            np.save(OUT / f"logits_{arch}_f32.npy", np.asarray(llm.scores[:len(PROMPT_IDS)], np.float32))


if __name__ == "__main__":
    main()
