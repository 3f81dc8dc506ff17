"""Make tests/fixtures/gated_delta/recurrent.npz with transformers' own gated delta rule as the independent reference.

    /work/refenv/bin/python scripts/make_gated_delta_fixture.py

Run from the repository root in the reference environment (transformers 5.17, torch CPU); it imports nothing from
surojax. Deterministic (a fixed seed). One row of 67 tokens (a whole chunk of 64 and a partial one), 2 heads,
Dk 16, Dv 8; the inputs stored as float16 (small; the reference runs on exactly those values, in fp32):

q, k [B, T, H, Dk]   L2-normalised (transformers' use_qk_l2norm_in_kernel=False: the caller normalises, as ours)
v [B, T, H, Dv]; g [B, T, H] log decay (-softplus: <= 0; head 0 slow, head 1 faster); beta [B, T, H] (sigmoid); initial_state [B, H, Dk, Dv]
o [B, T, H, Dv], final_state [B, H, Dk, Dv]   fp32: transformers.models.qwen3_5.modeling_qwen3_5.
    torch_recurrent_gated_delta_rule(q, k, v, g, beta, initial_state, output_final_state=True), which scales q by
    Dk^-0.5 itself
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from transformers.models.qwen3_5.modeling_qwen3_5 import torch_recurrent_gated_delta_rule

OUT = Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "gated_delta" / "recurrent.npz"


def inputs() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(38)
    B, T, H, Dk, Dv = 1, 67, 2, 16, 8

    def unit(shape):
        x = rng.standard_normal(shape)
        return x / np.linalg.norm(x, axis=-1, keepdims=True)

    def softplus(x):
        return np.log1p(np.exp(x))

    arrays = {"q": unit((B, T, H, Dk)), "k": unit((B, T, H, Dk)), "v": rng.standard_normal((B, T, H, Dv)),
              "g": -softplus(rng.standard_normal((B, T, H)) + np.array([-5.0, -1.0])),  # slow and fast decay
              "beta": 1 / (1 + np.exp(-rng.standard_normal((B, T, H)))),
              "initial_state": 0.5 * rng.standard_normal((B, H, Dk, Dv))}
    return {name: x.astype(np.float16) for name, x in arrays.items()}


def main() -> None:
    arrays = inputs()
    q, k, v, g, beta, s0 = (torch.from_numpy(arrays[n].astype(np.float32))
                            for n in ("q", "k", "v", "g", "beta", "initial_state"))
    o, state = torch_recurrent_gated_delta_rule(q, k, v, g, beta, initial_state=s0, output_final_state=True)
    OUT.parent.mkdir(parents=True, exist_ok=True)
    np.savez_compressed(OUT, **arrays, o=o.numpy().astype(np.float32), final_state=state.numpy().astype(np.float32))
    print(f"wrote {OUT} ({OUT.stat().st_size} bytes)")


if __name__ == "__main__":
    main()
