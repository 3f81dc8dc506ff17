"""`python -m surojax.train --config` on 8 virtual CPU devices with `parallel: {data: 2, expert: 4}` gives the losses
of one device on the same global batches, for a tiny random qwen3_moe (8 experts, top-2) trained in full.

The expert-parallel run holds 2 of the 8 experts per device and splits the global batch of 8 rows over data x expert
(1 row per device); the single-device run takes the 8 rows at once. fp32; not bit-equal (each token's expert
outputs and the replicated parameters' gradients are summed across devices in another order), hence rel 1e-4.
The same holds for a LoRA adapter on attention + experts with the router trained alongside.
"""
import json
import os
import subprocess
import sys

import jax
import numpy as np
import yaml
from flax import nnx

from surojax.cli.train_script import main as train_main

from surojax.models.config import ModelConfig
from surojax.models.decoder import Decoder
from surojax.weights.hf_checkpoint import save_model

from tests.tiny import QWEN3_MOE, hf
from tests.train.conftest import ROOT

TINY_QWEN3_MOE = hf(QWEN3_MOE, num_experts=8, norm_topk_prob=True)


def _train(config, devices: int) -> list[float]:
    """Run the training command on `devices` CPU devices (1: in this one-device process, no child start-up); the
    per-step losses of its metrics.jsonl."""
    if devices == 1:
        assert jax.device_count() == 1
        assert train_main(["--config", str(config)]) == 0
    else:
        # the child compiles like this process (the suite's XLA_FLAGS kept, the device count appended)
        flags = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={devices}".strip()
        env = {**os.environ, "PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu", "XLA_FLAGS": flags}
        r = subprocess.run([sys.executable, "-m", "surojax.train", "--config", str(config)], cwd=ROOT, env=env,
                           capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stderr[-3000:]
    out = yaml.safe_load(open(config))["output_dir"]
    rows = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl")).read().splitlines()]
    return [row["loss"] for row in sorted((r for r in rows if "loss" in r), key=lambda r: r["step"])]


# LoRA on attention + experts (the expert adapters [L, E, in, R] sharded over `expert` like their kernels), the
# router trained with them
LORA = dict(lora=True, lora_rank=4, lora_alpha=8, lora_target_modules="all-linear", train_router=True,
            learning_rate=1e-2)


def test_data_2_expert_4_matches_one_device(tmp_path, tiny_config):
    """LoRA on attention + experts with the router trained (full fine-tuning's exchange and gradients on the expert
    mesh: tests/parallel/test_expert_parallel.py)."""
    common = dict(model_config=dict(TINY_QWEN3_MOE), max_steps=3, gradient_accumulation_steps=1,
                  lr_scheduler_type="constant")
    # LoRA needs a base folder: the same tiny random qwen3_moe, saved
    base = save_model(Decoder(ModelConfig.from_hf(dict(TINY_QWEN3_MOE)), rngs=nnx.Rngs(0)), tmp_path / "base")
    common = dict(common, from_scratch=False, model_config=None, model=str(base), **LORA)
    one_cfg, ep_cfg = tmp_path / "one.yaml", tmp_path / "ep.yaml"
    def write(path, **kw):  # None: a key of tiny_config's left out
        path.write_text(yaml.safe_dump({k: v for k, v in tiny_config(**common, **kw).items() if v is not None}))

    write(one_cfg, output_dir=str(tmp_path / "one"), per_device_train_batch_size=8)
    write(ep_cfg, output_dir=str(tmp_path / "ep"), per_device_train_batch_size=1, parallel={"data": 2, "expert": 4})
    one, ep = _train(one_cfg, 1), _train(ep_cfg, 8)
    assert len(one) == 3
    np.testing.assert_allclose(ep, one, rtol=1e-4)
    assert one[2] < one[0]  # it trains
