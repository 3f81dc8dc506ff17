"""Make the golden GGUF fixtures in tests/fixtures/gguf/ with llama.cpp itself as the independent reference.

    python scripts/make_gguf_fixtures.py --llama-python /work/llamaenv/bin/python

Run it from the repository root in the surojax environment (jax, gguf, tokenizers). `--llama-python` is a
separate Python (3.12 here) with llama-cpp-python built from source by pip, made with

    python3.12 -m venv /work/llamaenv
    CMAKE_ARGS="-DGGML_NATIVE=OFF" MAKEFLAGS=-j2 /work/llamaenv/bin/pip install llama-cpp-python numpy

(llama-cpp-python 0.3.36, which vendors llama.cpp with ggml 0.25.3; GGML_NATIVE=OFF keeps ggml-base, where the
reference quantisers live, at the x86-64 baseline: no FMA contraction). The llama.cpp side runs in a subprocess
(the code in LLAMA_SIDE below); nothing is downloaded. What it writes (deterministic: fixed seeds, no clocks):

kquants.npz   `x` [R, 512] float32 test rows (normal, Student-t(2) heavy tails, shifted uniform, all-zero,
              constant, partly zero, tiny values) and `q2_k` .. `q6_k`, `iq4_nl`, `iq4_xs`: the bytes of ggml's
              own quantiser (`ggml_quantize_chunk` with no importance matrix: `quantize_row_q*_K_ref`,
              `quantize_iq4_nl` / `quantize_iq4_xs`) for those rows.
models.json   for each tiny model (tests/weights/gguf_tiny.py: qwen3, llama and qwen2, hidden 256 so the K-quants
              apply; qwen3_tied with a tied head) and file type (f32, q8_0, q4_k_m; qwen2 f32, q8_0;
              qwen3_tied f32, q4_k_m): the sha256 of the .gguf our writer makes (byte
              stability), and the per-tensor GGUF types and data sha256 of the file llama.cpp's own
              `llama_model_quantize` makes from our F32 file (so the q4_k_m mix and bytes can be compared);
              for qwen3's q2_k, q3_k_m, q5_k_m, q6_k, iq4_xs only the latter.
logits_<family>_<type>.npy   llama.cpp's logits (logits_all) for PROMPT on our file, float32 [T, V].
"""
from __future__ import annotations

import argparse
import hashlib
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
OUT = ROOT / "tests" / "fixtures" / "gguf"

KQUANT_TYPES = ("q2_k", "q3_k", "q4_k", "q5_k", "q6_k", "iq4_nl", "iq4_xs")
FILE_TYPES = ("f32", "q8_0", "q4_k_m")  # logits too
QUANTIZE_ONLY = ("q2_k", "q3_k_m", "q5_k_m", "q6_k", "iq4_xs")  # llama_model_quantize digests only
FAMILIES = ("qwen3", "llama", "qwen2", "qwen3_tied")
FAMILY_TYPES = {"qwen2": ("f32", "q8_0"), "qwen3_tied": ("f32", "q4_k_m")}  # fewer files

LLAMA_SIDE = r'''
import ctypes, hashlib, json, sys, pathlib
import numpy as np
import llama_cpp

job = json.loads(sys.argv[1])
lib_dir = pathlib.Path(llama_cpp.__file__).parent / "lib"
ggml = ctypes.CDLL(str(lib_dir / "libggml-base.so"))
ggml.ggml_quantize_chunk.restype = ctypes.c_size_t
ggml.ggml_quantize_chunk.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64,
                                     ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p]
ggml.ggml_row_size.restype = ctypes.c_size_t
ggml.ggml_row_size.argtypes = [ctypes.c_int, ctypes.c_int64]
out = {}
if job["kind"] == "quantize_rows":
    x = np.ascontiguousarray(np.load(job["x"]), np.float32)
    for name, t in job["types"].items():
        rs = ggml.ggml_row_size(t, x.shape[1])
        q = np.zeros((x.shape[0], rs), np.uint8)
        assert ggml.ggml_quantize_chunk(t, x.ctypes.data, q.ctypes.data, 0, x.shape[0], x.shape[1], None) == q.size
        np.save(job["dst"] + name + ".npy", q)
elif job["kind"] == "logits":
    llm = llama_cpp.Llama(job["gguf"], n_ctx=64, logits_all=True, verbose=False, n_threads=2, seed=0)
    llm.eval(job["ids"])
    np.save(job["dst"], np.asarray(llm.scores[:len(job["ids"])], np.float32))
elif job["kind"] == "quantize_file":
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = job["ftype"]
    params.nthread = 1
    rc = llama_cpp.llama_model_quantize(job["src"].encode(), job["dst"].encode(), ctypes.byref(params))
    assert rc == 0, rc
print(json.dumps(out))
'''


def llama_side(py: str, job: dict) -> None:
    subprocess.run([py, "-c", LLAMA_SIDE, json.dumps(job)], check=True)


def sha256(path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def test_rows() -> np.ndarray:
    rng = np.random.default_rng(1)
    x = np.concatenate([rng.normal(size=(8, 512)), rng.standard_t(2, size=(8, 512)),
                        rng.uniform(-1, 3, size=(4, 512)), np.zeros((1, 512)), np.full((1, 512), 0.5),
                        1e-6 * rng.normal(size=(1, 512)), rng.normal(size=(1, 512))]).astype(np.float32)
    x[-1, :40] = 0.0
    x[-1, 100:164] = np.abs(x[-1, 100:164])  # a non-negative sub-block (min clamps at 0)
    return x


def make_kquants(py: str, tmp: Path) -> None:
    import gguf

    x = test_rows()
    np.save(tmp / "x.npy", x)
    types = {t: int(gguf.GGMLQuantizationType[t.upper()]) for t in KQUANT_TYPES}
    llama_side(py, {"kind": "quantize_rows", "x": str(tmp / "x.npy"), "types": types, "dst": str(tmp / "kq_")})
    np.savez_compressed(OUT / "kquants.npz", x=x, **{t: np.load(tmp / f"kq_{t}.npy") for t in KQUANT_TYPES})


def tensor_digest(path) -> dict:
    import gguf

    r = gguf.GGUFReader(path)
    return {t.name: [t.tensor_type.name.lower(), hashlib.sha256(np.ascontiguousarray(t.data).tobytes()).hexdigest()]
            for t in r.tensors}


def make_models(py: str, tmp: Path) -> None:
    import gguf
    from tests.weights.gguf_tiny import PROMPT_IDS, tiny_model_dir

    from surojax.quant.quantize_mix import FILE_TYPES as FT
    from surojax.weights.gguf_checkpoint import save_gguf

    manifest = {"prompt_ids": PROMPT_IDS, "models": {}}
    for family in FAMILIES:
        model_dir = tiny_model_dir(family, tmp / family)
        for ft in FAMILY_TYPES.get(family, FILE_TYPES):
            path = tmp / f"{family}-{ft}.gguf"
            save_gguf(model_dir, path, ft)
            entry = {"sha256": sha256(path)}
            llama_side(py, {"kind": "logits", "gguf": str(path), "ids": PROMPT_IDS,
                            "dst": str(OUT / f"logits_{family}_{ft}.npy")})
            if ft != "f32":
                ref = tmp / f"{family}-{ft}-llamacpp.gguf"
                llama_side(py, {"kind": "quantize_file", "src": str(tmp / f"{family}-f32.gguf"), "dst": str(ref),
                                "ftype": int(FT[ft][0])})
                entry["llama_quantize"] = tensor_digest(ref)
            manifest["models"][f"{family}-{ft}"] = entry
        # the mix rule and bytes of more file types, against llama.cpp's quantiser
        for ft in QUANTIZE_ONLY if family == "qwen3" else ():
            ref = tmp / f"{family}-{ft}-llamacpp.gguf"
            llama_side(py, {"kind": "quantize_file", "src": str(tmp / f"{family}-f32.gguf"), "dst": str(ref),
                            "ftype": int(FT[ft][0])})
            manifest["models"][f"{family}-{ft}"] = {"llama_quantize": tensor_digest(ref)}
    (OUT / "models.json").write_text(json.dumps(manifest, indent=1, sort_keys=True) + "\n")
    del gguf


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--llama-python", required=True, help="a Python with llama-cpp-python installed")
    ap.add_argument("--only", choices=("kquants", "models"))
    args = ap.parse_args()
    OUT.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as d:
        if args.only in (None, "kquants"):
            make_kquants(args.llama_python, Path(d))
        if args.only in (None, "models"):
            make_models(args.llama_python, Path(d))


if __name__ == "__main__":
    main()
