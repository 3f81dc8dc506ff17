"""The offload optimizers' in-place step update (surojax/offload/optimizer.py `in_place`, issue 6) (CPU).

Exactness: with the state / master in host memory `update_and_apply` (gradients divided and clipped per layer,
params / state / master written back into the carried buffers) equals the same update with everything on the
device bit for bit (params, state, master, losses). Against the whole-tree form of the same optimizer
(`grads / denom`, chain.update, apply_updates) it is the same math; XLA sums the global norm in another order
there (1 ulp of the norm), so losses and fp32 weights agree to rtol 1e-6 / 1e-5 (the bf16 copies to 1 ulp).

Memory: XLA's buffer assignment of the compiled step (surojax/bench/step_memory.py, abstract arguments, nothing
built) at 2 and 6 layers. The whole-tree form keeps ~4 copies of the layers' fp32 gradient-sized arrays as
temporaries (grads / denom, the clipped grads, the stacked updates, the new state the scan stacks): 16 bytes per
layer parameter. In place, what grows with the depth is the gradients themselves (4 bytes fp32; 2 with
offload_master and one micro-batch, whose bf16 gradients are used as they are) plus, on the CPU backend only, a
broadcast of the scalar divisor its reduction kernels take as an operand (~1.5 bytes per parameter).
"""
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from surojax.bench.shapes import model_config, shape_hf_config
from surojax.bench.step_memory import abstract_step_args, step_memory
from surojax.bench.train_bench import BenchConfig
from surojax.losses.lm import lm_loss
from surojax.models.config import ModelConfig
from surojax.models.decoder import Decoder
from surojax.offload.memory_plan import plan_memory
from surojax.offload.optimizer import apply_master_updates, clipped_layerwise, compute_copy
from surojax.models.layer_runner import LayerScan, Recompute, with_runner
from surojax.offload.streaming import HOST_KIND
from surojax.parallel import make_mesh, shard_model
from surojax.train.optim import decay_mask, init_opt_state
from surojax.train.step import make_train_step

from tests.offload.layerwise_runs import _batch
from tests import tiny

CFG = tiny.model_config(tiny.QWEN3, vocab_size=128)


def _run(*, in_place: bool, offload: bool, master: bool, A: int, steps=2):
    mesh = make_mesh({"data": 1, "fsdp": 1, "tensor": 1}, devices=jax.devices()[:1])
    model = Decoder(CFG, dtype=jnp.bfloat16, param_dtype=jnp.float32, rngs=nnx.Rngs(0))  # the bf16 recipe
    model = with_runner(model, LayerScan(Recompute.FULL))
    graphdef, trainable, frozen = nnx.split(shard_model(model, mesh), nnx.Param, ...)
    opt = clipped_layerwise(optax.adamw(1e-2, weight_decay=0.1, mask=decay_mask), offload=offload, master=master,
                            max_grad_norm=0.5)
    if not in_place:  # the same chain without update_and_apply: make_train_step's whole-tree update
        opt = optax.GradientTransformation(opt.init, opt.update)
    state = init_opt_state(opt, trainable, mesh)
    if master:
        trainable = compute_copy(trainable, jnp.bfloat16)
    step = make_train_step(graphdef, lm_loss, opt,
                           apply_updates=apply_master_updates if master else optax.apply_updates)
    losses, norms = [], []
    for _ in range(steps):
        trainable, state, m = step(trainable, frozen, state, _batch(A=A), jax.random.key(0))
        losses.append(float(m["loss"]))
        norms.append(float(m["grad_norm"]))
    return losses, norms, trainable, state


# (False, 2): accumulation, fp32 params; (True, 1): the master, its bf16 gradients used as they are. Master with
# accumulation (the fp32 accumulator) against the whole-tree update: the Trainer test in test_master_offload.py
# (offload_master + offload_optimizer, accumulation 2, against the resident whole-tree Trainer), each program
# here being ~10 s of compiling
@pytest.mark.parametrize("master,A", [(False, 2), (True, 1)])
def test_in_place_update_offloaded_equals_on_device_and_the_whole_tree_update(master, A):
    l_host, n_host, p_host, s_host = _run(in_place=True, offload=True, master=master, A=A)
    l_dev, n_dev, p_dev, s_dev = _run(in_place=True, offload=False, master=master, A=A)
    assert l_host == l_dev and n_host == n_dev and l_host[-1] < l_host[0]
    assert n_host[0] > 0.5  # the clip is active
    for a, b in zip(jax.tree.leaves((p_host, s_host)), jax.tree.leaves((p_dev, s_dev)), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))  # the memory space is the only difference
    lw = s_host[-1]
    host = jax.tree.leaves((lw.layers, lw.master if master else []))
    assert {x.sharding.memory_kind for x in host} == {HOST_KIND}  # written back in place, still on host
    # the whole-tree form: the same math; its global norm sums the materialised grads / denom where the in-place
    # form's reduction reads them fused (another summation order: 1 ulp of the norm), hence rtol
    l_wt, n_wt, p_wt, s_wt = _run(in_place=False, offload=True, master=master, A=A)
    np.testing.assert_allclose(l_host, l_wt, rtol=1e-6)
    np.testing.assert_allclose(n_host, n_wt, rtol=1e-6)
    for a, b in zip(jax.tree.leaves((p_host, s_host)), jax.tree.leaves((p_wt, s_wt)), strict=True):
        assert a.dtype == b.dtype and a.sharding.memory_kind == b.sharding.memory_kind
        rtol = 1e-5 if a.dtype == jnp.float32 else 2 ** -7  # bf16 compute copies: 1 ulp where the master crosses
        np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32), rtol=rtol, atol=1e-6)


def _moved_shapes(jaxpr, out=None) -> list:
    """(shape, space) of every value a device_put in the (nested) jaxpr moves between memory spaces."""
    out = [] if out is None else out
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "device_put":
            out += [(tuple(v.aval.shape), d) for v, d in zip(eqn.invars, eqn.params["devices"])
                    if isinstance(d, jax.memory.Space)]
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
            _moved_shapes(sub, out)
    return out


def test_host_state_crosses_one_layer_at_a_time():
    bc = BenchConfig(shape="debug", mode="full", batch=1, seq=128, min_segment=16, lmhead_chunks=1,
                     recompute="full", offload_optimizer=True, offload_master=True)
    step, args = abstract_step_args(bc, layers=3)
    moved = _moved_shapes(jax.make_jaxpr(step)(*args).jaxpr)
    host_leaves = [x for x in jax.tree.leaves(args[2]) if x.sharding.memory_kind == HOST_KIND]
    layer_shapes = {x.shape[1:] for x in host_leaves}
    for space in (jax.memory.Space.Device, jax.memory.Space.Host):  # each host leaf's slice, both ways
        assert sum(1 for shape, d in moved if d == space) >= len(host_leaves)
    assert {shape for shape, _ in moved} <= layer_shapes  # never a whole [L, ...] leaf


def _layer_params(cfg) -> int:
    embed = cfg.vocab_size * cfg.hidden_size * (1 if cfg.tie_word_embeddings else 2) + cfg.hidden_size
    return (cfg.num_params() - embed) // cfg.num_layers


@pytest.mark.parametrize("master,limit", [(False, 8.0), (True, 6.0)])
def test_step_temporaries_grow_by_one_gradient_per_layer(master, limit):
    bc = BenchConfig(shape="debug", mode="full", batch=1, seq=128, min_segment=16, lmhead_chunks=1,
                     recompute="full", offload_optimizer=True, offload_master=master)
    shallow, deep = step_memory(bc, layers=2), step_memory(bc, layers=6)
    per_param = (deep["temp"] - shallow["temp"]) / 4 / _layer_params(model_config("debug"))
    assert per_param < limit, per_param  # today's main: 16.4 bytes per layer parameter in both modes
    assert deep["output_not_aliased"] < 1024  # the metrics: every param / state / master lands in its donated buffer
    # the state's host arguments: 8 bytes per layer parameter (AdamW), + 4 for the master
    host_per_param = (deep["host_argument"] - shallow["host_argument"]) / 4 / _layer_params(model_config("debug"))
    assert host_per_param == pytest.approx(12.0 if master else 8.0, rel=0.01)
    # the memory plan grows like the compiled device peak (less the CPU-only broadcast of the divisor)
    plans = [plan_memory(ModelConfig.from_hf(dict(shape_hf_config("debug"), num_hidden_layers=n)), mode="full",
                         batch=1, seq=128, recompute=Recompute.FULL, lm_chunk_tokens=128, offload_optimizer=True,
                         offload_master=master) for n in (2, 6)]
    plan_per_param = (plans[1].total - plans[0].total) / 4 / _layer_params(model_config("debug"))
    peak_per_param = (deep["device_peak"] - shallow["device_peak"]) / 4 / _layer_params(model_config("debug"))
    assert peak_per_param - 2.0 <= plan_per_param <= peak_per_param + 0.5, (plan_per_param, peak_per_param)
    assert plans[1].host == pytest.approx(deep["host_argument"], rel=1e-3)  # + the per-layer step counts


# Qwen3-like widths at which every layer tensor is >= adamw_8bit's min_8bit_size (4096 values: 8-bit moments for all
# of them) but which compile in seconds (the compile time hardly depends on the widths; measured at Qwen3-0.6B
# widths the slope drowned in the embedding's temporaries, -16 bytes per parameter between 1 and 3 layers)
WIDE = dict(model_type="qwen3", vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=64, rope_theta=1e6, rms_norm_eps=1e-6,
            tie_word_embeddings=True)


def test_full_fine_tune_adamw_8bit_step_holds_one_gradient_copy_per_layer(monkeypatch):
    """Issue 19: full fine-tuning with optimizer_layerwise updates its layers in place (build.layerwise_update), and
    adamw_8bit quantises large tensors chunk by chunk. XLA's temporaries then grow by the fp32 gradients per layer
    parameter (4 bytes; the CPU backend adds a broadcast of the divisor, ~1.5-3) instead of the whole-tree update's
    ~40 bytes (measured at Qwen3-8B widths: 7.35 GiB per 0.19 G-parameter layer before, 1.2 after; at WIDE between
    2 and 4 layers: 4.0 bytes per layer parameter in place, 39.8 with layerwise_update off)."""
    from surojax.bench import shapes

    monkeypatch.setitem(shapes.SHAPES, "test-8bit", WIDE)
    bc = BenchConfig(shape="test-8bit", mode="full", optimizer="adamw_8bit", batch=1, seq=64, recompute="full",
                     segments=1, optimizer_layerwise=True)
    a, b = (step_memory(bc, layers=n)["temp"] for n in (2, 4))
    cfg = ModelConfig.from_hf(WIDE)
    layers = nnx.state(nnx.eval_shape(lambda: Decoder(cfg, rngs=nnx.Rngs(0))), nnx.Param)["layers"]
    assert min(x.size // x.shape[0] for x in jax.tree.leaves(layers) if x.ndim == 3) >= 4096  # all 8-bit moments
    per_param = (b - a) / 2 / _layer_params(cfg)
    assert per_param <= 8, per_param
