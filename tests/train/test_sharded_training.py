"""The trainer on a data=2 x fsdp=2 x tensor=2 mesh of 8 virtual CPU devices gives the losses of the same
global batches on one device (fp32; the sums over shards are taken in another order, hence a tolerance).

The 8-device run is a check of the one 8-device child that tests/parallel/virtual_devices.py shares with
test_sharding, test_zero and test_expert_parallel (no process start-up of its own); the one-device reference trains
in this process on the same config (but the mesh and the per-device batch) and compares the losses the check returns.
"""
import os
import sys
import tempfile
from pathlib import Path

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if ROOT not in sys.path:  # the shared child imports this module
    sys.path.insert(0, ROOT)

import numpy as np  # noqa: E402

from tests.parallel.virtual_devices import check_passed, shared_child_results  # noqa: E402
from tests.tiny import QWEN3, hf  # noqa: E402
from tests.train.conftest import TOKENIZER, write_text_data  # noqa: E402

STEPS = 3


def _config(tmp: Path, **overrides) -> dict:
    """tests/train/conftest.py's tiny fp32 from-scratch run (its tiny_config), 3 steps, no accumulation."""
    cfg = {"from_scratch": True, "tokenizer": str(TOKENIZER), "model_config": hf(QWEN3),
           "output_dir": str(tmp / "out"), "recipe": "fp32", "recompute": "none",
           "datasets": [{"path": str(write_text_data(tmp / "text.jsonl")), "type": "text"}],
           "sequence_len": 64, "gradient_accumulation_steps": 1, "learning_rate": 3e-3,
           "lr_scheduler_type": "constant", "max_steps": STEPS, "seed": 0}
    return {**cfg, **overrides}


def _losses(config: dict):
    """(losses of STEPS steps, the trainer's device count, the specs of its trainable arrays)."""
    import jax

    from surojax.config import config_from_dict
    from surojax.train.trainer import Trainer

    t = Trainer(config_from_dict(config))
    try:
        losses = [float(t.step()["loss"]) for _ in range(STEPS)]
        return losses, jax.device_count(), {str(v.sharding.spec) for v in jax.tree.leaves(t.trainable)}
    finally:
        t.close()


CHILD_CHECKS: dict = {}


def check_trainer_on_data_2_fsdp_2_tensor_2():
    """In the 8-device child: the trainer on the 2x2x2 mesh, 1 row per device (the global batch of 4 rows the
    reference takes on one device) -> its losses."""
    with tempfile.TemporaryDirectory() as tmp:
        losses, devices, specs = _losses(_config(Path(tmp), per_device_train_batch_size=1,
                                                 parallel={"data": 2, "fsdp": 2, "tensor": 2}))
    assert devices == 8
    assert any("fsdp" in s or "tensor" in s for s in specs), specs  # the parameters really are sharded
    return losses


CHILD_CHECKS["check_trainer_on_data_2_fsdp_2_tensor_2"] = check_trainer_on_data_2_fsdp_2_tensor_2


def test_data_fsdp_tensor_mesh_matches_one_device(tmp_path, tmp_path_factory):
    one, devices, _ = _losses(_config(tmp_path, per_device_train_batch_size=4))  # before waiting for the child
    assert devices == 1
    results = shared_child_results(tmp_path_factory, __file__, devices=8)
    name = "check_trainer_on_data_2_fsdp_2_tensor_2"
    check_passed(results, name, "8 devices")
    np.testing.assert_allclose(results[f"{name}.value"], one, rtol=2e-5)
    assert one[2] < one[0]
