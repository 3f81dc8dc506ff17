"""Serving one image prompt per user on a random-weight Qwen3-VL (surojax.bench.shapes, the tower included): the
engine in-process, no HTTP, at 1 / 16 users (issue 41's serving row; benchmarks/campaigns/vlm_lora.py runs it).

Each request is one chat-like prompt: 16 text tokens, <|vision_start|>, a SIDE x SIDE image's image tokens
((SIDE / 16)^2 / 4), <|vision_end|>, 16 text tokens, as serve/image_prompt.py lays it out (ImagePrompt: M-RoPE
positions, the pixels' sha256), every user its own random pixels (no prefix-cache hit between them), greedy, no
stop tokens (every request makes --max-tokens new tokens). The vision tower runs in each prompt's prefill. A
warm-up round of 4-token outputs compiles the shapes first. Metrics as benchmarks/serve_load.py's `summarize`:
aggregate decode tok/s, output tok/s, TTFT p50 / p99 (the TTFT includes the tower and the prefill).

    python3 benchmarks/campaigns/vlm_serve.py                               # qwen3-vl-2b, side 448, users 1,16
    python3 benchmarks/campaigns/vlm_serve.py --shape debug-vl --side 64 --max-tokens 8 --users 1,2   # CPU
Prints `RESULT {json}` per users count.
"""
from __future__ import annotations

import argparse
import hashlib
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from serve_load import emit, summarize  # noqa: E402  (benchmarks/: the same metrics as the text serving rows)

TEXT = 16  # text tokens before and after the image


def build_model(shape: str, dtype_name: str):
    """Random weights of `shape` (language model and tower) built in one jit on the first device, laid out for
    decode as `surojax serve` does."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from surojax.bench.shapes import model_config
    from surojax.models.decoder import Decoder
    from surojax.models.vision.config import VisionConfig
    from surojax.models.vision.tower import VisionTower
    from surojax.parallel import init_sharded, make_mesh
    from surojax.quant.laid_out import decode_weights

    cfg = model_config(shape)
    dtype = jnp.bfloat16 if dtype_name == "bfloat16" else jnp.float32

    def build():
        model = Decoder(cfg, dtype=dtype, param_dtype=dtype, attention="xla", rngs=nnx.Rngs(0))
        model.visual = VisionTower(VisionConfig.from_hf(cfg.hf_extra["vision_config"], cfg.model_type),
                                   param_dtype=dtype, rngs=nnx.Rngs(1))
        return model

    model = init_sharded(build, make_mesh({"data": 1}, jax.devices()[:1]))
    decode_weights(model, join_projections=True)
    return model


def image_prompt(model, side: int, rng: np.random.Generator):
    """One ImagePrompt (serve/image_prompt.py's fields) with a random side x side image."""
    from surojax.models.vision.inputs import VisionTokens
    from surojax.models.vision.mrope import mrope_positions
    from surojax.serve.image_prompt import ImagePrompt

    tokens, hf = VisionTokens.from_config(model.cfg), model.cfg.hf_extra
    v = tokens.vision
    grid = side // v.patch_size
    n = grid * grid // v.spatial_merge_size ** 2
    low = min(tokens.image_token_id, tokens.vision_start_token_id, tokens.video_token_id)
    text = rng.integers(10, low - 1, size=2 * TEXT).tolist()
    ids = text[:TEXT] + [tokens.vision_start_token_id] + [tokens.image_token_id] * n + \
        [int(hf["vision_end_token_id"])] + text[TEXT:]
    pixels = rng.standard_normal((grid * grid, v.in_channels * v.temporal_patch_size * v.patch_size ** 2),
                                 dtype=np.float32)
    grids = np.array([[1, grid, grid]], np.int64)
    pos, delta = mrope_positions(np.array([ids]), grids, image_token_id=tokens.image_token_id,
                                 video_token_id=tokens.video_token_id,
                                 vision_start_token_id=tokens.vision_start_token_id,
                                 spatial_merge_size=v.spatial_merge_size)
    return ImagePrompt(ids, pixels, grids, ((TEXT + 1, n),), (hashlib.sha256(pixels.tobytes()).hexdigest(),),
                       pos[:, 0], int(delta[0]))


def run_users(model, users: int, side: int, max_tokens: int, rounds: int, seed: int) -> dict:
    from surojax.generation.sampling import SamplingParams
    from surojax.serve.config import EngineConfig, SchedulerConfig
    from surojax.serve.engine import Engine

    rng = np.random.default_rng(seed)
    prompt_len = len(image_prompt(model, side, rng).ids)
    block = 16
    max_len = prompt_len + max_tokens + block
    engine = Engine(model, EngineConfig(
        scheduler=SchedulerConfig(max_num_seqs=users, max_num_batched_tokens=users * prompt_len + users,
                                  max_model_len=max_len),
        block_size=block, num_blocks=users * (-(-max_len // block)) + 8))

    def one_round(new_tokens: int) -> list:
        prompts = [image_prompt(model, side, rng) for _ in range(users)]
        t0 = time.perf_counter()
        ts = {engine.add_request(p.ids, SamplingParams(max_tokens=new_tokens), images=p): []
              for p in prompts}
        while engine.has_unfinished():
            outs = engine.step()
            now = time.perf_counter()
            for o in outs:
                ts[o.request_id] += [now] * len(o.new_token_ids)
        return [(t0, v) for v in ts.values()]

    one_round(4)  # compiles the prefill (with the tower) and decode shapes
    t = time.perf_counter()
    records = [r for _ in range(rounds) for r in one_round(max_tokens)]
    return summarize("engine", users, records, time.perf_counter() - t,
                     {"side": side, "prompt_tokens": prompt_len, "image_tokens": prompt_len - 2 * TEXT - 2,
                      "max_tokens": max_tokens, "rounds": rounds})


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", default="qwen3-vl-2b")
    ap.add_argument("--side", type=int, default=448)
    ap.add_argument("--users", default="1,16")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--dtype", default="auto", choices=("auto", "bfloat16", "float32"))
    a = ap.parse_args()
    import jax

    dtype = a.dtype if a.dtype != "auto" else ("bfloat16" if jax.default_backend() == "gpu" else "float32")
    model = build_model(a.shape, dtype)
    print(f"# {a.shape} {dtype} on {jax.devices()[0].device_kind}, image {a.side}x{a.side}", flush=True)
    for users in (int(u) for u in a.users.split(",")):
        emit({**run_users(model, users, a.side, a.max_tokens, a.rounds, seed=users), "shape": a.shape,
              "dtype": dtype, "batch": users})
    return 0


if __name__ == "__main__":
    sys.exit(main())
