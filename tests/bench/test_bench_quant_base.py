"""`surojax bench train --quant FMT`: LoRA over a random quantised base (surojax.bench.quant_base), CPU debug shape."""
from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from surojax.bench.train_bench import BenchConfig
from surojax.quant.random_weights import random_weight
from bench.test_train_bench import bench


@pytest.mark.parametrize("name", ["q6_k", "nf4", "nvfp4", "fp8"])  # the four builder paths
def test_random_weights_are_finite_and_modest(name):
    w = random_weight(name, 256, 32, jax.random.key(0), (2,))
    assert w.name == name and w.shape == (256, 32)
    d = np.asarray(w.dequantize(jnp.float32))
    assert d.shape == (2, 256, 32) and np.isfinite(d).all() and 0 < np.abs(d).max() < 10


def test_bench_train_over_a_quantised_base(capsys):
    rc, stdout, stderr = bench(capsys, "--quant", "nf4", "--steps", "1", "--repeats", "1", "--warmup", "1", "--batch",
                               "2", "--seq", "128")
    assert rc == 0, stderr
    out = json.loads(stdout.strip().splitlines()[-1])
    assert out["config"]["quant"] == "nf4" and out["config"]["quant_matmul"] == "auto"
    assert np.isfinite(out["loss"]) and out["tokens_per_s"] > 0
    plain = 32768 + 2 * (64 * 64 * 2 + 64 * 32 * 2 + 3 * 64 * 128)  # adapters + the base's logical values
    assert out["params_total"] == plain + 512 * 64 + 2 * 2 * 64 + 64 + 2 * 2 * 16  # + embedding and norms
    with pytest.raises(ValueError, match="--mode lora"):
        BenchConfig(shape="debug", mode="full", quant="nf4").check()
    with pytest.raises(ValueError, match="--quant 'q4_0'"):
        BenchConfig(shape="debug", quant="q4_0").check()


def test_cli_choices_are_the_lists_the_bench_checks():
    """cli/bench.py spells its choices out (its parser is built without importing jax): they must stay equal to
    the lists BenchConfig.check() uses, and --quant's to the formats that have a fused kernel."""
    import argparse

    from surojax.quant import FUSED_KERNEL_FORMATS
    from surojax.bench.quant_base import GGUF_LEGACY_FORMATS, KERNEL_FORMATS
    from surojax.quant.random_weights import RANDOM_FORMATS
    from surojax.bench.shapes import SHAPES
    from surojax.cli.bench import add_arguments

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    choices = {a.dest: tuple(a.choices) for a in parser._actions if a.choices}
    assert choices["shape"] == tuple(SHAPES)
    assert choices["quant"] == KERNEL_FORMATS and set(KERNEL_FORMATS) == FUSED_KERNEL_FORMATS
    assert choices["base_format"] == GGUF_LEGACY_FORMATS
    assert set(KERNEL_FORMATS) | set(GGUF_LEGACY_FORMATS) == set(RANDOM_FORMATS)
