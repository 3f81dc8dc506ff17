"""A random-weight GGUF of a benchmark shape, for the llama.cpp serving anchor (benchmarks/anchors/llama_cpp_anchor.sh).

Speed does not depend on the weight values, so the anchor serves a random model of the shape serve_load.py uses
(surojax.bench.shapes), written by our GGUF writer (surojax.weights.gguf_checkpoint.save_gguf, whose files
llama.cpp loads: tests/weights) with the qwen3 fixture's byte-level BPE tokenizer padded to the model's vocabulary.
llama.cpp's own llama-quantize then makes the Q4_K_M file from the bf16 one, as a user would.

A quantised file type (--file-type q4_k_m) is written directly, for shapes whose bf16 file does not fit the disk
(Qwen3-30B-A3B: 61 GB): each quantised matrix gets random codes with sane block scales
(surojax.quant.random_weights, the formats' own layout, which is GGUF's block layout) in the type llama-quantize's
mix gives it (surojax.quant.quantize_mix), and only the small tensors the file keeps in float (norms, routers)
are drawn as values. Quantising 30B random values on the host would take over an hour.

    python benchmarks/anchors/random_gguf.py --shape qwen3-0.6b --out /tmp/model-bf16.gguf [--file-type bf16]
"""
from __future__ import annotations

import argparse
import itertools
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from flax import nnx  # noqa: E402

import numpy as np  # noqa: E402

from surojax.bench.shapes import model_config  # noqa: E402
from surojax.models.decoder import Decoder  # noqa: E402
from surojax.quant.random_weights import RANDOM_FORMATS, random_weight  # noqa: E402
from surojax.weights.gguf_checkpoint import encode_values, save_gguf  # noqa: E402

FLOAT_TYPES = ("f32", "f16", "bf16")
SMALL = 2**24  # values: a tensor this small is drawn (norms, routers, biases); a larger one is a matrix to encode

TOKENIZER = ROOT / "tests" / "fixtures" / "models" / "qwen3"


def random_model(cfg) -> Decoder:
    """A Decoder of cfg's shape with normal(0, 0.02) weights in bf16 (norms near 1) on the default device; a layer
    stack of more than 2^28 values is drawn one layer at a time into its buffer: initialising the module itself
    draws each stack in float32 first (Qwen3-30B-A3B's expert stack: 77 GB), which does not fit an 80 GB card
    beside the 61 GB model. (surojax.offload.host_init.random_placed_model draws in numpy on the host: minutes at
    30B values.)"""
    model = nnx.eval_shape(lambda: Decoder(cfg, dtype=jnp.bfloat16, param_dtype=jnp.bfloat16, attention="xla",
                                           rngs=nnx.Rngs(0)))
    fill = jax.jit(lambda x, i, key: x.at[i].set((0.02 * jax.random.normal(key, x.shape[1:])).astype(x.dtype)),
                   donate_argnums=0)
    state = nnx.state(model, nnx.Param)
    key = jax.random.key(0)
    leaves, treedef = jax.tree.flatten(state)
    made = []
    for n, leaf in enumerate(leaves):
        k = jax.random.fold_in(key, n)
        if leaf.ndim <= 1:  # norms near 1
            x = (1 + 0.02 * jax.random.normal(k, leaf.shape)).astype(leaf.dtype)
        elif leaf.size <= 2**28 or leaf.shape[0] > 1024:  # at most ~1 GiB of float32 draws at once, or not a stack
            x = (0.02 * jax.random.normal(k, leaf.shape)).astype(leaf.dtype)
        else:  # a layer stack: one layer at a time
            x = jnp.zeros(leaf.shape, leaf.dtype)
            for i in range(leaf.shape[0]):
                x = fill(x, i, jax.random.fold_in(k, i))
        made.append(x)
    nnx.update(model, jax.tree.unflatten(treedef, made))
    return model


def shape_only_model(cfg) -> Decoder:
    """A Decoder of cfg's shape for writing random codes: its small tensors drawn on the host in float32 (norms near
    1, routers and the rest normal(0, 0.02): the routing of a random model spreads over the experts), every larger
    one a zero-strided float32 view of 0 (no memory), which `random_codes` replaces by codes."""
    model = nnx.eval_shape(lambda: Decoder(cfg, dtype=jnp.bfloat16, param_dtype=jnp.bfloat16, attention="xla",
                                           rngs=nnx.Rngs(0)))
    state = nnx.state(model, nnx.Param)
    paths_leaves, treedef = jax.tree_util.tree_flatten_with_path(state)
    rng = np.random.default_rng(0)
    made = []
    for path, leaf in paths_leaves:
        if leaf.size > SMALL:
            made.append(np.broadcast_to(np.float32(0), leaf.shape))
        elif "norm" in jax.tree_util.keystr(path):
            made.append((1 + 0.02 * rng.standard_normal(leaf.shape)).astype(np.float32))
        else:
            made.append((0.02 * rng.standard_normal(leaf.shape)).astype(np.float32))
    nnx.update(model, jax.tree.unflatten(treedef, made))
    return model


def random_codes(key):
    """An encoder for save_gguf: a matrix written in a quantised type gets random codes of that type (its values
    are ignored), any other keeps its values."""
    import gguf

    count = itertools.count()

    def encode(w: np.ndarray, qtype: str):
        if qtype not in RANDOM_FORMATS:  # floats, and types without a random builder
            return encode_values(w, qtype)
        *lead, n, k = w.shape
        q = random_weight(qtype, k, n, jax.random.fold_in(key, next(count)), lead=tuple(lead))
        raw = np.asarray(jax.device_get(q.data)).view(np.uint8).reshape(*w.shape[:-1], -1)
        return raw, gguf.GGMLQuantizationType[qtype.upper()]
    return encode


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="qwen3-0.6b")
    p.add_argument("--out", required=True)
    p.add_argument("--file-type", default="bf16", help="a save_gguf file type (bf16, q8_0, q4_k_m, ...)")
    a = p.parse_args(argv)
    cfg = model_config(a.shape)
    if a.file_type in FLOAT_TYPES:
        path = save_gguf(random_model(cfg), a.out, a.file_type, tokenizer_dir=TOKENIZER, name=a.shape)
    else:
        path = save_gguf(shape_only_model(cfg), a.out, a.file_type, tokenizer_dir=TOKENIZER, name=a.shape,
                         encode=random_codes(jax.random.key(0)))
    print(f"# wrote {path} ({path.stat().st_size / 2**20:.0f} MiB, {a.shape}, {a.file_type}) on {jax.devices()[0].platform}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
