"""Make tests/fixtures/mxfp4/ with transformers' own GPT-OSS MXFP4 dequantisation as the independent reference.

    /work/refenv/bin/python scripts/make_mxfp4_fixtures.py

Run from the repository root in the reference environment (transformers 5.17, torch CPU); it imports nothing from
surojax. What it writes (deterministic: a fixed seed):

vectors.npz   `blocks` [2, 16, 8, 16] uint8 and `scales` [2, 16, 8] uint8 in the published `_blocks` / `_scales`
              layout: the scales run over every E8M0 exponent 0..254 (0xFF, NaN in the spec, excluded), the bytes
              of the first 16 blocks over every value 0..255 and the rest random; `dequantized` [2, 256, 16]
              uint16: the bits of the bfloat16 tensor transformers.integrations.mxfp4.convert_moe_packed_tensors
              returns for them ([E, in, out], the layout transformers' GptOssExperts keeps).
checkpoint.json   for each expert projection of tests/fixtures/models/gpt_oss_mxfp4 (its `_blocks` / `_scales`
              pairs): the shape and sha256 of the bfloat16 bytes convert_moe_packed_tensors makes of them.
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import torch
from safetensors import safe_open
from transformers.integrations.mxfp4 import convert_moe_packed_tensors

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "tests" / "fixtures" / "mxfp4"
CHECKPOINT = ROOT / "tests" / "fixtures" / "models" / "gpt_oss_mxfp4" / "model.safetensors"


def reference(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """transformers' dequantisation -> the bfloat16 bits as uint16."""
    out = convert_moe_packed_tensors(torch.from_numpy(blocks), torch.from_numpy(scales), dtype=torch.bfloat16)
    return out.contiguous().view(torch.int16).numpy().view(np.uint16)


def vectors() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(36)
    E, N, G = 2, 16, 8
    blocks = rng.integers(0, 256, (E * N * G, 16), dtype=np.uint8)
    blocks[:16] = np.arange(256, dtype=np.uint8).reshape(16, 16)  # every byte value, so every code in both nibbles
    scales = (np.arange(E * N * G) % 255).astype(np.uint8)  # every exponent 0..254
    rng.shuffle(scales)
    blocks, scales = blocks.reshape(E, N, G, 16), scales.reshape(E, N, G)
    return {"blocks": blocks, "scales": scales, "dequantized": reference(blocks, scales)}


def checkpoint_digests() -> dict[str, dict]:
    out = {}
    with safe_open(str(CHECKPOINT), framework="numpy") as f:  # the uint8 pairs only (numpy has no bfloat16)
        for name in sorted(n[: -len("_blocks")] for n in f.keys() if n.endswith("_blocks")):
            bits = reference(f.get_tensor(name + "_blocks"), f.get_tensor(name + "_scales"))
            out[name] = {"shape": list(bits.shape), "sha256": hashlib.sha256(bits.tobytes()).hexdigest()}
    return out


def main() -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    np.savez_compressed(OUT / "vectors.npz", **vectors())
    (OUT / "checkpoint.json").write_text(json.dumps(checkpoint_digests(), indent=2) + "\n")
    print("wrote", sorted(p.name for p in OUT.iterdir()))


if __name__ == "__main__":
    main()
