"""offload_optimizer: the layers' optimizer state in pinned host memory, updated one layer at a time (CPU).

Exactness: the offloaded per-layer update equals the same per-layer update with the state on the device bit for
bit (the memory space is the only difference). Against the plain whole-tree optax update (the Trainer without
offload_optimizer) it agrees to 1 ulp of the update (XLA compiles the same elementwise math inside a loop body
differently: 2.8e-9 on updates of 1e-2), so the Trainer's losses are compared with rtol 1e-6.
"""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from surojax.losses.lm import lm_loss
from surojax.models.config import ModelConfig
from surojax.models.decoder import Decoder
from surojax.offload.optimizer import (HostLayerwiseState, LayerwiseState, apply_master_updates, compute_copy,
                                       layerwise)
from surojax.offload.remat import remat_wrapper
from surojax.offload.streaming import HOST_KIND
from surojax.parallel import make_mesh, shard_model
from surojax.train.optim import build_optimizer, decay_mask, init_opt_state
from surojax.train.step import make_train_step

from tests.offload.test_streaming import _device_puts
from tests.train.conftest import TINY_QWEN3

CFG = ModelConfig.from_hf(dict(TINY_QWEN3, vocab_size=128))


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
    graphdef, trainable, frozen = nnx.split(shard_model(model, mesh), nnx.Param, ...)
    inner = optax.adamw(1e-2, weight_decay=0.1, mask=decay_mask)
    opt = optax.chain(optax.clip_by_global_norm(1.0), layerwise(inner, offload=offload_state, master=master))
    state = init_opt_state(opt, trainable, mesh)  # on the fp32 params: the master is their copy
    if master:
        trainable = compute_copy(trainable, jnp.bfloat16)
    step = make_train_step(graphdef, lm_loss, opt, layer_loop=remat_wrapper("full"), donate=False,
                           apply_updates=apply_master_updates if master else optax.apply_updates)
    losses = []
    for _ in range(steps):
        trainable, state, m = step(trainable, frozen, state, _batch(), jax.random.key(0))
        losses.append(float(m["loss"]))
    return losses, trainable, state, step, frozen


@functools.cache
def device_layerwise_run():
    """The per-layer update with everything on the device: the reference of the offloaded state here and of the
    host master in test_master_offload.py (one ~10 s compile for both where they share a process; read only, the
    step does not donate)."""
    return _run(offload_state=False)


def test_offloaded_state_lives_on_host_and_updates_exactly_like_the_device_state():
    l_host, p_host, s_host, step, frozen = _run(offload_state=True)
    l_dev, p_dev, s_dev, _, _ = device_layerwise_run()
    assert l_host == l_dev and l_host[-1] < l_host[0]
    assert max(float(np.max(np.abs(np.asarray(a) - np.asarray(b))))
               for a, b in zip(jax.tree.leaves(p_host), jax.tree.leaves(p_dev), strict=True)) == 0
    assert isinstance(s_dev[1], LayerwiseState) and not isinstance(s_dev[1], HostLayerwiseState)
    lw = s_host[1]
    assert isinstance(lw, HostLayerwiseState)
    assert {x.sharding.memory_kind for x in jax.tree.leaves(lw.layers)} == {HOST_KIND}  # still on host after steps
    assert {x.sharding.memory_kind for x in jax.tree.leaves(lw.rest)} == {"device"}
    # every per-layer state leaf goes back to host inside the per-layer scan
    jaxpr = jax.make_jaxpr(step.__wrapped__ if hasattr(step, "__wrapped__") else step)(
        p_host, frozen, s_host, _batch(), jax.random.key(0)).jaxpr
    assert _device_puts(jaxpr, jax.memory.Space.Host) >= len(jax.tree.leaves(lw.layers))


# the Trainer with offload_optimizer alone against the resident Trainer: in test_master_offload.py's Trainer test,
# which shares that resident run


def test_build_optimizer_offload_state_wraps_the_update():
    opt = build_optimizer("adamw", optax.constant_schedule(1e-3), offload_state=True)
    state = jax.eval_shape(opt.init, {"layers": {"w": jnp.ones((3, 4, 4))}, "head": {"w": jnp.ones((4, 4))}})
    lw = state[1]
    assert isinstance(lw, HostLayerwiseState)
    assert all(x.shape[0] == 3 for x in jax.tree.leaves(lw.layers))  # one state per layer, counts included
