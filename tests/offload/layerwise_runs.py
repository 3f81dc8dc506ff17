"""The per-layer (`layerwise`) training runs that test_optimizer_offload.py and test_master_offload.py compare, and
their batch. A module of its own, imported as `tests.offload.layerwise_runs` by both, so that the cached device
run is one object when both test modules run in one process (pytest imports the test modules themselves under
another name than `tests.offload.test_...`)."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from surojax.losses.lm import lm_loss
from surojax.models.decoder import Decoder
from surojax.offload.optimizer import apply_master_updates, compute_copy, layerwise
from surojax.models.layer_runner import LayerScan, Recompute, with_runner
from surojax.parallel import make_mesh, shard_model
from surojax.train.optim import decay_mask, init_opt_state
from surojax.train.step import make_train_step

from tests.tiny import QWEN3, model_config

CFG = model_config(QWEN3, vocab_size=128)


def _batch(A=2, B=2, T=16):
    rng = np.random.default_rng(0)
    return {"tokens": rng.integers(1, 128, (A, B, T)).astype(np.int32),
            "positions": np.broadcast_to(np.arange(T, dtype=np.int32), (A, B, T)).copy(),
            "segment_ids": np.ones((A, B, T), np.int32), "targets": rng.integers(1, 128, (A, B, T)).astype(np.int32),
            "loss_mask": np.ones((A, B, T), np.float32)}


def _run(offload_state: bool, master: bool = False, steps=3):
    """`steps` steps of AdamW behind a global-norm clip, per layer (`layerwise`), on the bf16 recipe's model (fp32
    params computed in bf16); the state in host memory when `offload_state`, the fp32 master there when `master`
    (the device then trains the params' bf16 copy)."""
    mesh = make_mesh({"data": 1, "fsdp": 1, "tensor": 1}, devices=jax.devices()[:1])
    model = Decoder(CFG, dtype=jnp.bfloat16, param_dtype=jnp.float32, rngs=nnx.Rngs(0))  # the bf16 recipe
    model = with_runner(model, LayerScan(Recompute.FULL))
    graphdef, trainable, frozen = nnx.split(shard_model(model, mesh), nnx.Param, ...)
    inner = optax.adamw(1e-2, weight_decay=0.1, mask=decay_mask)
    opt = optax.chain(optax.clip_by_global_norm(1.0), layerwise(inner, offload=offload_state, master=master))
    state = init_opt_state(opt, trainable, mesh)  # on the fp32 params: the master is their copy
    if master:
        trainable = compute_copy(trainable, jnp.bfloat16)
    step = make_train_step(graphdef, lm_loss, opt, donate=False,
                           apply_updates=apply_master_updates if master else optax.apply_updates)
    losses = []
    for _ in range(steps):
        trainable, state, m = step(trainable, frozen, state, _batch(), jax.random.key(0))
        losses.append(float(m["loss"]))
    return losses, trainable, state, step, frozen


@functools.cache
def device_layerwise_run():
    """The per-layer update with everything on the device: the reference of the offloaded state
    (test_optimizer_offload.py) and of the host master (test_master_offload.py); one ~10 s compile for both where
    they share a process. Read only (the step does not donate)."""
    return _run(offload_state=False)
