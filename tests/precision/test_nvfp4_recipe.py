"""recipe: nvfp4 — each piece against an independent reference written from the paper's formulas (arXiv 2509.25149):
the quantisers' bit patterns (NumPy + ml_dtypes' own E2M1 / E4M3 casts), the 16x16 tiles' transpose symmetry, the
RHT's orthogonality, stochastic rounding's unbiasedness (a statistical test), the custom-VJP GEMMs against the
fake-quantised product computed by hand, and a tiny run through the trainer."""
import json

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax import nnx

from surojax.config import ConfigError, config_from_dict
from surojax.precision.hadamard import apply_rht, hadamard, random_signs, rht_matrix
from surojax.precision.nvfp4_matmul import nvfp4_dot, nvfp4_dot_frozen
from surojax.precision.nvfp4_quant import quantize_1x16, quantize_16x16, round_e2m1
from surojax.precision.nvfp4_transform import Nvfp4Linear, bf16_layers

F4, F8 = ml_dtypes.float4_e2m1fn, ml_dtypes.float8_e4m3fn
q1x16 = jax.jit(quantize_1x16, static_argnums=1)  # one compile each instead of op-by-op dispatch
q16x16 = jax.jit(quantize_16x16)
rht = jax.jit(apply_rht, static_argnums=1)


def reference_quantize(x: np.ndarray, tile: tuple[int, int]):
    """NumPy, from the paper: s_enc = 6*448/amax; scale_b = E4M3(amax_b/6 * s_enc); q = E2M1(x * s_enc/scale_b);
    both casts by ml_dtypes (round to nearest even), saturating. Returns (E2M1 bits, E4M3 bits, 1/s_enc)."""
    x = x.astype(np.float32)
    r, c = x.shape
    tr, tc = tile
    blocks = np.abs(x).reshape(r // tr, tr, c // tc, tc).max(axis=(1, 3))  # [R/tr, C/tc]
    s_enc = np.float32(6 * 448) / np.float32(np.abs(x).max())
    scale = np.minimum(blocks / np.float32(6) * s_enc, np.float32(448)).astype(F8)
    full = np.repeat(np.repeat(scale.astype(np.float32), tr, 0), tc, 1)
    with np.errstate(divide="ignore", invalid="ignore"):
        ratio = np.where(full > 0, s_enc / full, np.float32(0)).astype(np.float32)
    q = np.clip(x * ratio, -6, 6).astype(F4)
    if tile == (1, 16):
        scale = scale.reshape(r, c // 16)
    return q.view(np.uint8), scale.view(np.uint8), np.float32(1) / s_enc


@pytest.fixture(scope="module")
def data():
    rng = np.random.default_rng(0)
    # magnitudes over ~2^20 per 16x16 tile (E4M3 subnormal scales included), one all-zero tile
    x = rng.standard_normal((64, 48)).astype(np.float32) * np.exp2(rng.integers(-14, 6, (4, 1, 3, 1))).repeat(
        16, 1).repeat(16, 3).reshape(64, 48).astype(np.float32)
    x[:16, :16] = 0
    return x


@pytest.mark.parametrize("tile", [(1, 16), (16, 16)])
def test_quantiser_bit_patterns_match_the_paper_formulas(data, tile):
    q = q1x16(jnp.asarray(data)) if tile == (1, 16) else q16x16(jnp.asarray(data))
    codes, scales, g = reference_quantize(data, tile)
    np.testing.assert_array_equal(np.asarray(q.values).astype(F4).view(np.uint8), codes)
    np.testing.assert_array_equal(np.asarray(q.scale).astype(F8).view(np.uint8), scales)
    assert float(np.asarray(q.global_decode).reshape(())) == g
    assert (np.asarray(q.scale) < 2.0 ** -6).any()  # subnormal E4M3 scales were exercised
    deq = np.asarray(q.dequantize())
    blocks = np.asarray(q.blocks(jnp.bfloat16)).astype(np.float32)
    np.testing.assert_array_equal(blocks, np.asarray(q.values) * np.asarray(q.block_scale()))  # exact in bf16
    # bound: half an E2M1 step of the rounded value's binade (0.5 below 2, 1 below 4, 2 above) times the block's
    # effective scale, plus, at the clip (|q| = 6), what the block's scale lost to rounding down (at most E4M3's half
    # ulp: s * 2^-4 / (1 - 2^-4) when normal, 2^-10 when subnormal) times 6 * g
    units, bs = np.abs(np.asarray(q.values)), np.asarray(q.block_scale())
    half_step = np.where(units < 2, 0.25, np.where(units < 4, 0.5, 1.0)) * bs * g
    clip = np.where(units == 6, 6 * g * np.maximum(2.0 ** -10, bs / 15), 0)
    flushed = bs == 0  # the block's scale underflowed E4M3 (<= 2^-10 rounds to 0): the block is 0
    bound = np.where(flushed, 6 * 2.0 ** -10 * g, half_step + clip)
    assert (np.abs(deq - data) <= bound * (1 + 1e-5) + 1e-6 * np.abs(data)).all()


def test_16x16_tiles_quantise_w_and_w_transposed_alike(data):
    w = jnp.asarray(data)
    np.testing.assert_array_equal(np.asarray(q16x16(w).dequantize()).T,
                                  np.asarray(q16x16(w.T).dequantize()))
    np.testing.assert_array_equal(np.asarray(q16x16(w).T.values), np.asarray(q16x16(w.T).values))
    # 1x16 blocks do not have that property (the reason the recipe tiles the weights)
    assert not np.array_equal(np.asarray(q1x16(w).dequantize()).T, np.asarray(q1x16(w.T).dequantize()))


def test_rht_is_orthogonal_and_leaves_a_product_unchanged():
    i, j = np.meshgrid(np.arange(16), np.arange(16), indexing="ij")
    sylvester = (-1.0) ** np.vectorize(lambda a: bin(a).count("1"))(i & j)  # H[i, j] = (-1)^popcount(i & j)
    np.testing.assert_array_equal(hadamard(16), sylvester)
    signs = random_signs(3)
    assert set(signs) == {-1, 1} and signs == random_signs(3)
    r = rht_matrix(signs)
    np.testing.assert_array_equal(r @ r.T, np.eye(16))  # exact: entries +-1/4
    rng = np.random.default_rng(1)
    a, b = rng.standard_normal((8, 48)), rng.standard_normal((5, 48))
    a[0, 7] = 300.0  # an outlier: the transform spreads it over its block of 16
    ta, tb = np.asarray(rht(jnp.asarray(a), signs)), np.asarray(rht(jnp.asarray(b), signs))
    np.testing.assert_allclose(ta @ tb.T, a @ b.T, rtol=1e-5, atol=1e-3)
    assert np.abs(ta[0, :16]).max() < 300.0 / 3.9


def test_stochastic_rounding_is_unbiased_and_rne_is_not():
    x = jnp.asarray([0.3, 0.7, 1.1, 1.8, 2.6, 3.3, 4.9, 5.5, -0.2, -2.2], jnp.float32)
    n = 20000
    draws = jax.jit(jax.vmap(lambda k: round_e2m1(x, "sr", k)))(jax.random.split(jax.random.key(0), n))
    lo = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 4, 0, 2]) * np.sign(x)
    hi = np.array([0.5, 1, 1.5, 2, 3, 4, 6, 6, 0.5, 3]) * np.sign(x)
    d = np.asarray(draws)
    assert all(np.isin(d[:, i], [lo[i], hi[i]]).all() for i in range(len(lo)))  # only the two neighbours
    p = (np.asarray(x) - lo) / (hi - lo)
    sigma = np.abs(hi - lo) * np.sqrt(p * (1 - p) / n)
    assert (np.abs(d.mean(0) - np.asarray(x)) < 4 * sigma).all()  # unbiased, within 4 sigma
    rne_bias = np.abs(np.asarray(round_e2m1(x)) - np.asarray(x))
    assert (rne_bias > 10 * sigma).all()  # round-to-nearest is off by a fixed amount the test can see


@pytest.fixture(scope="module")
def gemm_case():
    rng = np.random.default_rng(2)
    x = jnp.asarray(rng.standard_normal((5, 8, 32)), jnp.float32)  # M = 40 tokens: padded to 48 for the Wgrad
    w = jnp.asarray(rng.standard_normal((32, 48)) * 0.1, jnp.float32)
    g = jnp.asarray(rng.standard_normal((5, 8, 48)), jnp.float32)
    key = jax.random.key_data(jax.random.key(7))
    signs = random_signs(0)

    @jax.jit
    def run(x, w, g):
        y, vjp = jax.vjp(lambda x, w: nvfp4_dot(x, w, key, signs), x, w)
        return (y, *vjp(g))
    return x, w, g, key, signs, *run(x, w, g)


def test_custom_vjp_gemms_equal_the_fake_quantised_products(gemm_case):
    x, w, g, key, signs, y, dx, dw = gemm_case
    deq = lambda t: np.asarray(t.dequantize(), np.float64)  # noqa: E731
    x2, g2 = x.reshape(40, 32), g.reshape(40, 48)
    k_dgrad, k_wgrad = jax.random.split(jax.random.wrap_key_data(key))
    w_q = deq(q16x16(w))
    np.testing.assert_allclose(np.asarray(y).reshape(40, 48), deq(q1x16(x2)) @ w_q, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(dx).reshape(40, 32), deq(q1x16(g2, "sr", k_dgrad)) @ w_q.T,
                               rtol=1e-5, atol=1e-5)
    pad = lambda t: jnp.pad(t.T, ((0, 0), (0, 8)))  # noqa: E731  tokens last, 40 -> 48
    xh = deq(q1x16(rht(pad(x2), signs)))
    gh = deq(q1x16(rht(pad(g2), signs), "sr", k_wgrad))
    np.testing.assert_allclose(np.asarray(dw), xh @ gh.T, rtol=1e-5, atol=1e-5)
    exact = np.asarray(x2, np.float64).T @ np.asarray(g2, np.float64)
    assert np.linalg.norm(np.asarray(dw) - exact) < 0.2 * np.linalg.norm(exact)  # NVFP4-sized error, not garbage
    # a frozen base quantised once gives the same forward and data gradient
    frozen = jax.jit(lambda x, g: (lambda y, f: (y, f(g)[0]))(
        *jax.vjp(lambda x: nvfp4_dot_frozen(x, q16x16(w).compact(), key), x)))
    yf, dxf = frozen(x, g)
    np.testing.assert_array_equal(np.asarray(yf), np.asarray(y))
    np.testing.assert_array_equal(np.asarray(dxf), np.asarray(dx))


def test_config_rules_and_the_default_bf16_layers():
    base = {"model": "m", "datasets": [{"path": "d.jsonl"}]}
    assert config_from_dict({**base, "recipe": "nvfp4"}).recipe == "nvfp4"
    for bad, key in (({"lora": True, "qlora_fp4": True}, "recipe"), ({"lora": True, "merge_adapter": True},
                                                                       "merge_adapter")):
        with pytest.raises(ConfigError) as e:
            config_from_dict({**base, "recipe": "nvfp4", **bad})
        assert key in {p.key for p in e.value.problems}
    assert bf16_layers(62) == (2, 8) and bf16_layers(28) == (1, 4) and bf16_layers(2) == (0, 1)
    assert bf16_layers(28, 0, None) == (0, 4) and bf16_layers(28, None, 0) == (1, 0)


def test_nvfp4_trains_through_the_trainer(tmp_path):
    from surojax.train.trainer import Trainer
    from tests.tiny import QWEN3, hf
    from tests.train.conftest import TOKENIZER, write_text_data

    cfg = config_from_dict({
        "from_scratch": True, "tokenizer": str(TOKENIZER), "model_config": hf(QWEN3),
        "output_dir": str(tmp_path / "out"), "recipe": "nvfp4", "recompute": "none",
        "datasets": [{"path": str(write_text_data(tmp_path / "text.jsonl")), "type": "text"}],
        "sequence_len": 64, "per_device_train_batch_size": 2, "gradient_accumulation_steps": 2,
        "learning_rate": 3e-3, "lr_scheduler_type": "constant", "max_steps": 5, "seed": 0})
    trainer = Trainer(cfg)
    model = nnx.merge(trainer.run.graphdef, trainer.trainable, trainer.frozen)
    down = model.layers.mlp.down_proj
    assert isinstance(down, Nvfp4Linear)  # the kernel variable itself stays where it was (checkpoints, exports)
    np.testing.assert_array_equal(np.asarray(down.nvfp4_layers.get_value()), [True, False])  # 2 layers: 1 in bf16
    trainer.train()
    rows = [json.loads(line) for line in open(tmp_path / "out" / "metrics.jsonl")]
    losses = [r["loss"] for r in rows if "loss" in r]
    assert all(np.isfinite(losses)) and losses[-1] < losses[0] - 0.3
