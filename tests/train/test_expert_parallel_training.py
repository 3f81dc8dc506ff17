"""`python -m surojax.train --config` on 8 virtual CPU devices with `parallel: {data: 2, expert: 4}` gives the losses
of one device on the same global batches, for a tiny random qwen3_moe (8 experts, top-2) trained in full.

The expert-parallel run holds 2 of the 8 experts per device and splits the global batch of 8 rows over data x expert
(1 row per device); the single-device run takes the 8 rows at once. fp32; not bit-equal (each token's expert
outputs and the replicated parameters' gradients are summed across devices in another order), hence rel 1e-4.
The same holds for a LoRA adapter on attention + experts with the router trained alongside.

The 8-device run is a check of the one 8-device child that tests/parallel/virtual_devices.py shares with
test_sharding, test_zero, test_expert_parallel and test_sharded_training (no process start-up of its own); the
one-device reference trains in this process on the same config (but the mesh and the per-device batch) and compares
the losses the check returns.
"""
import json
import os
import sys
import tempfile
from pathlib import Path

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if ROOT not in sys.path:  # the shared child imports this module
    sys.path.insert(0, ROOT)

import jax  # noqa: E402
import numpy as np  # noqa: E402
import yaml  # noqa: E402
from flax import nnx  # noqa: E402

from surojax.cli.train_script import main as train_main  # noqa: E402

from surojax.models.config import ModelConfig  # noqa: E402
from surojax.models.decoder import Decoder  # noqa: E402
from surojax.weights.hf_checkpoint import save_model  # noqa: E402

from tests.parallel.virtual_devices import check_passed, shared_child_results  # noqa: E402
from tests.tiny import QWEN3_MOE, hf  # noqa: E402
from tests.train.conftest import TOKENIZER, write_text_data  # noqa: E402

TINY_QWEN3_MOE = hf(QWEN3_MOE, num_experts=8, norm_topk_prob=True)


def _train(config: Path) -> list[float]:
    """`python -m surojax.train --config CONFIG`'s main in this process (one device here, 8 in the shared child);
    the per-step losses of its metrics.jsonl."""
    assert train_main(["--config", str(config)]) == 0
    out = yaml.safe_load(open(config))["output_dir"]
    rows = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl")).read().splitlines()]
    return [row["loss"] for row in sorted((r for r in rows if "loss" in r), key=lambda r: r["step"])]


# LoRA on attention + experts (the expert adapters [L, E, in, R] sharded over `expert` like their kernels), the
# router trained with them
LORA = dict(lora=True, lora_rank=4, lora_alpha=8, lora_target_modules="all-linear", train_router=True,
            learning_rate=1e-2)


def _write_config(tmp: Path, name: str, **kw) -> Path:
    """tests/train/conftest.py's tiny fp32 run (its tiny_config) over a saved tiny random qwen3_moe base (the same
    weights in every process: Decoder(rngs=0)), LORA, 3 steps, no accumulation: tmp/NAME.yaml, output in
    tmp/NAME. LoRA needs a base folder."""
    base = tmp / "base"
    if not base.exists():
        save_model(Decoder(ModelConfig.from_hf(dict(TINY_QWEN3_MOE)), rngs=nnx.Rngs(0)), base)
    cfg = {"from_scratch": False, "model": str(base), "tokenizer": str(TOKENIZER), "output_dir": str(tmp / name),
           "recipe": "fp32", "recompute": "none",
           "datasets": [{"path": str(write_text_data(tmp / "text.jsonl")), "type": "text"}],
           "sequence_len": 64, "gradient_accumulation_steps": 1, "lr_scheduler_type": "constant", "max_steps": 3,
           "seed": 0, **LORA, **kw}
    path = tmp / f"{name}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


CHILD_CHECKS: dict = {}


def check_trainer_on_data_2_expert_4():
    """In the 8-device child (tests/parallel/virtual_devices.py's shared one: no process start-up of its own): the
    LoRA run on data 2 x expert 4, 1 row per device (the global batch of 8 rows the reference takes on one device)
    -> its losses."""
    assert jax.device_count() == 8
    with tempfile.TemporaryDirectory() as tmp:
        return _train(_write_config(Path(tmp), "ep", per_device_train_batch_size=1,
                                    parallel={"data": 2, "expert": 4}))


CHILD_CHECKS["check_trainer_on_data_2_expert_4"] = check_trainer_on_data_2_expert_4


def test_data_2_expert_4_matches_one_device(tmp_path, tmp_path_factory):
    """LoRA on attention + experts with the router trained (full fine-tuning's exchange and gradients on the expert
    mesh: tests/parallel/test_expert_parallel.py)."""
    assert jax.device_count() == 1
    one = _train(_write_config(tmp_path, "one", per_device_train_batch_size=8))  # before waiting for the child
    results = shared_child_results(tmp_path_factory, __file__, devices=8)
    name = "check_trainer_on_data_2_expert_4"
    check_passed(results, name, "8 devices")
    ep = results[f"{name}.value"]
    assert len(one) == 3
    np.testing.assert_allclose(ep, one, rtol=1e-4)
    assert one[2] < one[0]  # it trains
