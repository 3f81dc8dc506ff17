"""offload_optimizer: the layers' optimizer state in pinned host memory, updated one layer at a time (CPU).

Exactness: the offloaded per-layer update equals the same per-layer update with the state on the device bit for
bit (the memory space is the only difference). Against the plain whole-tree optax update (the Trainer without
offload_optimizer; that Trainer test is in test_master_offload.py, sharing its resident run) it agrees to 1 ulp of the update (XLA compiles the same elementwise math inside a loop body
differently: 2.8e-9 on updates of 1e-2), so the Trainer's losses are compared with rtol 1e-6.
"""
import jax
import jax.numpy as jnp
import numpy as np
import optax

from surojax.offload.optimizer import HostLayerwiseState, LayerwiseState
from surojax.offload.streaming import HOST_KIND
from surojax.train.optim import build_optimizer

from tests.offload.layerwise_runs import _batch, _run, device_layerwise_run
from tests.offload.test_streaming import _device_puts


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
