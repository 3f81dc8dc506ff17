"""Small quantised weights of every format with a fused kernel: quantised from a random matrix where the format
has a quantiser, random GGUF blocks (wrapped with from_gguf) for the K-quants."""
import numpy as np

from surojax.quant import FORMATS

KERNEL_FORMATS = ["q4_k", "q5_k", "q6_k", "q8_0", "nf4", "nf4-dq", "nvfp4", "fp8"]

# byte offsets of the fp16 super-block scales in one block: set to small positive normals so outputs stay sane
_F16 = {"q4_k": [0, 2], "q5_k": [0, 2], "q6_k": [208]}


def random_kquant(name: str, k: int, n: int, rng):
    cls = FORMATS[name]
    nb = n * k // cls.block_size
    raw = rng.integers(0, 256, size=(nb, cls.type_size), dtype=np.uint8)
    for off in _F16[name]:
        raw[:, off:off + 2] = rng.uniform(1e-3, 1e-2, nb).astype("<f2").view(np.uint8).reshape(-1, 2)
    return cls.from_gguf(raw.reshape(n, -1), k, n)


def make_weight(name: str, k: int, n: int, seed: int = 0):
    """A [K, N] weight in format `name` ("nf4-dq" = NF4 with double quantisation)."""
    rng = np.random.default_rng(seed)
    if name in _F16:
        return random_kquant(name, k, n, rng)
    w = (0.05 * rng.standard_normal((k, n))).astype(np.float32)
    if name == "nf4-dq":
        return FORMATS["nf4"].quantize(w, double_quant=True)
    return FORMATS[name].quantize(w)
