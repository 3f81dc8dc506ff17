"""GGUF types: dequantisation bit-exact against gguf.quants.dequantize (the reference) on random blocks;
quantisation through gguf.quants where the package can; pytree / jit behaviour."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

gguf = pytest.importorskip("gguf")

from surojax.quant import FORMATS, GGUF_TYPES, quantize  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")  # gguf on e8m0 = 255

# byte offsets of the fp16 fields inside one block (kept finite in the random blocks)
F16_FIELDS = {"q4_0": [0], "q4_1": [0, 2], "q5_0": [0], "q5_1": [0, 2], "q8_0": [0], "q2_k": [80, 82],
              "q3_k": [108], "q4_k": [0, 2], "q5_k": [0, 2], "q6_k": [208], "iq4_nl": [0], "iq4_xs": [0],
              "mxfp4": []}
QUANTISABLE = {"q4_0", "q4_1", "q5_0", "q5_1", "q8_0", "mxfp4", "f32", "f16", "bf16",
               "q2_k", "q3_k", "q4_k", "q5_k", "q6_k", "iq4_nl", "iq4_xs"}  # tests/quant/test_quantize_kquants.py
BLOCK_TYPES = sorted(F16_FIELDS)


def _qtype(cls):
    return gguf.GGMLQuantizationType(cls.ggml_type)


def _random_blocks(cls, n_rows, blocks_per_row, rng):
    raw = rng.integers(0, 256, size=(n_rows * blocks_per_row, cls.type_size), dtype=np.uint8)
    for off in F16_FIELDS[cls.name]:
        bits = rng.integers(0, 1 << 16, size=raw.shape[0], dtype=np.uint16)
        bits = np.where((bits & 0x7C00) == 0x7C00, bits & 0xBFFF, bits)  # no inf / nan: clear an exponent bit
        raw[:, off:off + 2] = bits.astype("<u2").view(np.uint8).reshape(-1, 2)
    return raw.reshape(n_rows, blocks_per_row * cls.type_size)


def test_registry_matches_gguf_constants():
    assert set(GGUF_TYPES) == set(BLOCK_TYPES) | {"f32", "f16", "bf16"}
    for name, cls in GGUF_TYPES.items():
        qt = _qtype(cls)
        assert qt.name.lower() == name
        assert gguf.GGML_QUANT_SIZES[qt] == (cls.block_size, cls.type_size)


@pytest.mark.parametrize("name", BLOCK_TYPES)
def test_dequantize_bit_exact_random_blocks(name):
    cls = FORMATS[name]
    rng = np.random.default_rng(abs(hash(name)) % 2**32)
    n, k = 24, 2 * max(cls.block_size, 256)
    raw = _random_blocks(cls, n, k // cls.block_size, rng)
    ref = gguf.quants.dequantize(raw, _qtype(cls))  # [N, K] float32
    assert ref.shape == (n, k)
    w = cls.from_gguf(raw, k, n)
    got = np.asarray(jax.jit(lambda f: f.dequantize(jnp.float32))(w))
    assert got.shape == (k, n)
    np.testing.assert_array_equal(got.T.view(np.uint32), ref.view(np.uint32))


@pytest.mark.parametrize("name", ["f32", "f16", "bf16"])
def test_float_types_bit_exact(name):
    cls = FORMATS[name]
    rng = np.random.default_rng(0)
    w = rng.normal(size=(64, 48)).astype(np.float32)
    f = cls.quantize(w)
    raw = np.asarray(f.data)
    ref = gguf.quants.dequantize(raw.view(np.uint8) if name == "bf16" else raw, _qtype(cls))
    got = np.asarray(f.dequantize(jnp.float32))
    np.testing.assert_array_equal(got.T.view(np.uint32), np.asarray(ref, np.float32).view(np.uint32))
    if name == "f32":
        np.testing.assert_array_equal(got, w)


# |dequantize(quantize(w)) - w| <= C * block absmax (C from each quantiser's step: Q4_0 maps the signed max to -8
# with step absmax/8, so values of the other sign clip at +7 steps: error up to one step; Q5_0 likewise absmax/16;
# Q8_0 half a step of absmax/127; Q4_1/Q5_1 range/15, range/31 <= 2 absmax/15, 2 absmax/31; MXFP4 keeps one binade of E2M1 under a
# power-of-two scale: the top step is up to a quarter of the absmax, and values past 6*scale are clipped)
ROUND_TRIP_C = {"q4_0": 1 / 8 * 1.02, "q4_1": 0.5 * 2 / 15 * 1.1, "q5_0": 1 / 16 * 1.02,
                "q5_1": 0.5 * 2 / 31 * 1.1, "q8_0": 0.5 / 127 * 1.1, "mxfp4": 0.5}


@pytest.mark.parametrize("name", sorted(ROUND_TRIP_C))
def test_quantize_matches_gguf_and_round_trips(name):
    cls = FORMATS[name]
    rng = np.random.default_rng(1)
    k, n = 256, 96
    w = rng.normal(size=(k, n)).astype(np.float32) * 0.02
    f = quantize(w, name)
    np.testing.assert_array_equal(np.asarray(f.data), gguf.quants.quantize(np.ascontiguousarray(w.T), _qtype(cls)))
    deq = np.asarray(f.dequantize(jnp.float32))
    blocks_amax = np.abs(w.T.reshape(n, -1, cls.block_size)).max(-1, keepdims=True)
    err = np.abs(deq.T - w.T).reshape(n, -1, cls.block_size)
    assert np.all(err <= ROUND_TRIP_C[name] * blocks_amax + 1e-7), (name, float((err / blocks_amax).max()))


def test_every_block_type_quantises():
    assert set(BLOCK_TYPES) <= QUANTISABLE


def test_pytree_jit_matmul_and_stacking():
    rng = np.random.default_rng(2)
    cls = FORMATS["q4_k"]
    k, n = 256, 16
    layers = [cls.from_gguf(_random_blocks(cls, n, 1, rng), k, n) for _ in range(3)]
    assert len(jax.tree.leaves(layers[0])) == 1 and layers[0].nbytes == n * 144
    stacked = jax.tree.map(lambda *xs: jnp.stack(xs), *layers)
    assert isinstance(stacked, cls) and stacked.shape == (k, n)
    full = stacked.dequantize(jnp.float32)
    assert full.shape == (3, k, n)
    np.testing.assert_array_equal(full[1], layers[1].dequantize(jnp.float32))

    def body(carry, w):  # scan slices the leading axis off the leaves: the static (K, N) stays valid
        return carry, w.matmul(carry)
    x = jnp.ones((2, k), jnp.float32) * 1e-3
    _, ys = jax.jit(lambda x, s: jax.lax.scan(body, x, s))(x, stacked)
    np.testing.assert_allclose(ys[2], x @ layers[2].dequantize(jnp.float32), rtol=1e-5, atol=1e-6)
    assert layers[0].dequantize().dtype == jnp.bfloat16
