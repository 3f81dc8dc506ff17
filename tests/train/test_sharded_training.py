"""The trainer on a data=2 x fsdp=2 x tensor=2 mesh of 8 virtual CPU devices gives the losses of the same
global batches on one device (fp32; the sums over shards are taken in another order, hence a tolerance)."""
import json
import os
import subprocess
import sys

import numpy as np
import yaml

from tests.train.conftest import ROOT

SCRIPT = """
import json, sys
from surojax.config import load_config
from surojax.train.trainer import Trainer
t = Trainer(load_config(sys.argv[1]))
losses = [t.step()["loss"] for _ in range(3)]
shardings = {str(v.sharding.spec) for v in __import__("jax").tree.leaves(t.trainable)}
print("RESULT " + json.dumps({"losses": losses, "devices": __import__("jax").device_count(),
                              "specs": sorted(shardings)}))
"""


def _one_device(config):
    """The same script's result in this (one-device) process: no child start-up for the reference."""
    import jax

    from surojax.config import load_config
    from surojax.train.trainer import Trainer
    t = Trainer(load_config(str(config)))
    losses = [t.step()["loss"] for _ in range(3)]
    t.close()
    return {"losses": losses, "devices": jax.device_count()}


def _run(config, devices):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu",
           "XLA_FLAGS": f"--xla_force_host_platform_device_count={devices}"}
    r = subprocess.run([sys.executable, "-c", SCRIPT, str(config)], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=240)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.split("RESULT ", 1)[1])


def test_data_fsdp_tensor_mesh_matches_one_device(tmp_path, tiny_config):
    common = dict(max_steps=3, gradient_accumulation_steps=1, lr_scheduler_type="constant")
    single = tmp_path / "single.yaml"
    single.write_text(yaml.safe_dump(tiny_config(output_dir=str(tmp_path / "a"), per_device_train_batch_size=4,
                                                 **common)))
    sharded = tmp_path / "sharded.yaml"
    sharded.write_text(yaml.safe_dump(tiny_config(output_dir=str(tmp_path / "b"), per_device_train_batch_size=1,
                                                  parallel={"data": 2, "fsdp": 2, "tensor": 2}, **common)))
    one, eight = _one_device(single), _run(sharded, 8)
    assert one["devices"] == 1 and eight["devices"] == 8
    assert any("fsdp" in s or "tensor" in s for s in eight["specs"])  # the parameters really are sharded
    np.testing.assert_allclose(eight["losses"], one["losses"], rtol=2e-5)
    assert one["losses"][2] < one["losses"][0]
