"""What llama.cpp's own converter writes for the Qwen3.5 fixtures (the `qwen35` and `qwen35moe` GGUF
architectures), and llama.cpp's logits on it: the independent reference of tests/weights/test_gguf_qwen35.py.

Run with the reference environment (torch + transformers), never from the surojax venv, giving the llama.cpp tree
that llama-cpp-python 0.3.36 vendors (its sdist: `pip download --no-binary :all: llama-cpp-python==0.3.36`, then
untar; the converter and its gguf-py 0.19.0 are read from there, nothing of them is copied into this repository):

    /work/refenv/bin/python scripts/make_qwen35_gguf_fixtures.py --llama-cpp <sdist>/vendor/llama.cpp

llama-cpp-python has no prebuilt wheel on the registry; for the logits below it is imported from the same sdist
with the llama library built by cmake from its vendor/llama.cpp (CPU, GGML_NATIVE=OFF, target `llama`: 5 minutes
on 2 cores; `pip install diskcache` in the refenv for its import):

    cmake -S <sdist>/vendor/llama.cpp -B <build> -DGGML_NATIVE=OFF -DBUILD_SHARED_LIBS=ON -DLLAMA_CURL=OFF \
        -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TOOLS=OFF -DLLAMA_BUILD_SERVER=OFF
    cmake --build <build> --target llama -j2
    PYTHONPATH=<sdist> LLAMA_CPP_LIB_PATH=<build>/bin /work/refenv/bin/python scripts/make_qwen35_gguf_fixtures.py ...

It writes:
    tests/fixtures/models/qwen3_5_gguf/   a tiny Qwen3_5ForCausalLM made by transformers (seed 0) whose shapes
        llama.cpp can run (linear key head dim = value head dim = 16; 2 key heads, 4 value heads so the value-head
        reorder applies; vocab 512 = the fixture tokenizer's, copied in; tied head; 4 layers [linear x 3, full];
        hidden 32, intermediate 64; every (1 + w) norm 0.3 N(0, 1), the gated norm 1 + 0.3 N(0, 1), dt_bias N(0, 1))
    tests/fixtures/gguf/qwen35_converter.json   for that folder (f32, f16, q8_0) and the two model fixtures
        qwen3_5_text / qwen3_5 (f32): the file's metadata (general.* and tokenizer.* left out: the converter's
        tokenizer step is skipped for the two vocab-256 fixtures, whose tokenizer is not in the folder) and per
        tensor [type, ne shape, sha256 of the data], plus ssm_a's values (-exp(A_log) by torch; compared with a
        tolerance, numpy's exp may differ in the last bit)
    tests/fixtures/gguf/logits_qwen35_f32.npy   when llama_cpp (llama-cpp-python 0.3.36) imports: its logits
        (logits_all) on the converter's f32 file of qwen3_5_gguf (with its tokenizer) for PROMPT_IDS
    tests/fixtures/models/qwen3_5_moe_gguf/   the same for Qwen3_5MoeForCausalLM (seed 0, the dense one's shapes
        and norms; 4 experts of width 32, top-2, a shared expert of width 32: every expert row quantises to Q8_0;
        the router and shared-expert gate N(0, 0.5) so the top-k choice is clear of ties)
    tests/fixtures/gguf/qwen35moe_converter.json   the same digest for qwen3_5_moe_gguf (f32, q8_0) and the MoE
        model fixtures qwen3_5_moe_text (f32, q8_0: its expert / shared-expert down rows of 16 / 24 values fall
        back to F16) and qwen3_5_moe (f32)
    tests/fixtures/gguf/logits_qwen35moe_f32.npy   llama.cpp's logits on the converter's f32 file of qwen3_5_moe_gguf
Deterministic: a re-run rewrites the same bytes.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
MODELS = ROOT / "tests" / "fixtures" / "models"
OUT = ROOT / "tests" / "fixtures" / "gguf"
TOKENIZER = ROOT / "tests" / "fixtures" / "tokenizer"
PROMPT_IDS = [507, 72, 101, 108, 108, 111, 32, 119, 111, 114, 108, 100, 44, 280, 301, 120]  # gguf_tiny's
# (output json, the llama.cpp-runnable folder, [(folder, file type)])
SETS = (("qwen35", "qwen3_5_gguf", (("qwen3_5_gguf", "f32"), ("qwen3_5_gguf", "f16"), ("qwen3_5_gguf", "q8_0"),
                                    ("qwen3_5_text", "f32"), ("qwen3_5", "f32"))),
        ("qwen35moe", "qwen3_5_moe_gguf", (("qwen3_5_moe_gguf", "f32"), ("qwen3_5_moe_gguf", "q8_0"),
                                           ("qwen3_5_moe_text", "f32"), ("qwen3_5_moe_text", "q8_0"),
                                           ("qwen3_5_moe", "f32"))))
SHAPES = dict(
    vocab_size=512, hidden_size=32, num_hidden_layers=4, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
    linear_key_head_dim=16, linear_value_head_dim=16, linear_conv_kernel_dim=4, rms_norm_eps=1e-6,
    max_position_embeddings=256, initializer_range=0.05, tie_word_embeddings=True, full_attention_interval=4,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25,
                     "mrope_section": [1, 1, 0], "mrope_interleaved": True}, bos_token_id=None,
    eos_token_id=None, pad_token_id=None)


def make_model(out: Path, moe: bool) -> None:
    from transformers import Qwen3_5ForCausalLM, Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig, Qwen3_5TextConfig

    if moe:
        cfg = Qwen3_5MoeTextConfig(**SHAPES, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                                   shared_expert_intermediate_size=32)
    else:
        cfg = Qwen3_5TextConfig(**SHAPES, intermediate_size=64)
    torch.manual_seed(0)
    model = (Qwen3_5MoeForCausalLM if moe else Qwen3_5ForCausalLM)(cfg).float().eval()
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("linear_attn.norm.weight"):
                p.copy_(1 + 0.3 * torch.randn(p.shape, generator=gen))
            elif name.endswith("norm.weight"):
                p.copy_(0.3 * torch.randn(p.shape, generator=gen))
            elif name.endswith("dt_bias"):
                p.copy_(torch.randn(p.shape, generator=gen))
            elif name.endswith(("mlp.gate.weight", "mlp.shared_expert_gate.weight")):
                p.copy_(0.5 * torch.randn(p.shape, generator=gen))
    if out.exists():
        shutil.rmtree(out)
    model.save_pretrained(out)
    for f in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy(TOKENIZER / f, out / f)


def convert(llama_cpp: Path, model_dir: Path, outtype: str, out: Path, vocab: bool) -> None:
    """llama.cpp's convert_hf_to_gguf.py, in this process (--no-mtp: the fixtures have no MTP layers); without
    `vocab` its tokenizer step is a no-op; with it, the fixture tokenizer (whose pre-tokenizer hash the converter
    does not list) is named `qwen2`, as surojax's writer names it (the logits below read token ids, no text)."""
    if str(llama_cpp) not in sys.path:
        sys.path[:0] = [str(llama_cpp), str(llama_cpp / "gguf-py")]
    import convert_hf_to_gguf
    from conversion import qwen

    patch = {"get_vocab_base_pre": lambda self, tokenizer: "qwen2"} if vocab else {"set_vocab": lambda self: None}
    classes = (qwen.Qwen3_5TextModel, qwen.Qwen3_5MoeTextModel)
    for c in classes:
        for name, fn in patch.items():
            setattr(c, name, fn)
    argv = sys.argv
    sys.argv = ["convert_hf_to_gguf.py", str(model_dir), "--outfile", str(out), "--outtype", outtype, "--no-mtp"]
    try:
        convert_hf_to_gguf.main()
    finally:
        sys.argv = argv
        for c in classes:  # the two classes define neither: their bases' methods come back
            for name in patch:
                delattr(c, name)


def describe(path: Path) -> dict:
    import gguf

    r = gguf.GGUFReader(path)
    meta = {}
    for k, f in r.fields.items():
        if k.startswith(("general.", "tokenizer.", "GGUF.")):
            continue
        v = f.contents()
        meta[k] = v
    tensors, ssm_a = {}, {}
    for t in r.tensors:
        data = np.ascontiguousarray(t.data)
        tensors[t.name] = [t.tensor_type.name, [int(n) for n in t.shape],
                           hashlib.sha256(data.tobytes()).hexdigest()]
        if t.name.endswith("ssm_a"):
            ssm_a[t.name] = [float(x) for x in np.asarray(data, np.float32).reshape(-1)]
    return {"metadata": meta, "tensors": tensors, "ssm_a": ssm_a}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--llama-cpp", type=Path, required=True, help="llama-cpp-python 0.3.36's vendor/llama.cpp")
    args = ap.parse_args()
    for arch, runnable, cases in SETS:
        make_model(MODELS / runnable, moe=arch == "qwen35moe")
        out = {}
        with tempfile.TemporaryDirectory() as tmp:
            for folder, outtype in cases:
                path = Path(tmp) / f"{folder}-{outtype}.gguf"
                convert(args.llama_cpp, MODELS / folder, outtype, path, vocab=False)
                out[f"{folder}-{outtype}"] = describe(path)
            (OUT / f"{arch}_converter.json").write_text(json.dumps(out, indent=1, sort_keys=True) + "\n")
            try:
                import llama_cpp
            except ImportError:
                print(f"llama_cpp is not importable: logits_{arch}_f32.npy not written")
                continue
            path = Path(tmp) / "with-vocab.gguf"
            convert(args.llama_cpp, MODELS / runnable, "f32", path, vocab=True)
            llm = llama_cpp.Llama(str(path), n_ctx=64, logits_all=True, verbose=False, n_threads=2)
            llm.eval(PROMPT_IDS)
            np.save(OUT / f"logits_{arch}_f32.npy", np.asarray(llm.scores[:len(PROMPT_IDS)], np.float32))


if __name__ == "__main__":
    main()
