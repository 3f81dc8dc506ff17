"""Bit-exactness protocol of `offload_base_weights` (CPU): the base streamed from host memory computes exactly what
the resident base computes.

    streamed  the frozen stacked layer weights in `pinned_host` memory, fetched per layer inside the scan
    resident  the same arrays in device memory

Checked: logits, the loss and every LoRA gradient (max abs diff 0.0) under recompute full / dots / offload (and
offload equals full),
gradient accumulation through the real train step, a quantised (NF4, double-quantised) base, and the Trainer (identical
losses over several steps). Vacuity guards: LoRA B is randomised (B = 0 would make A's gradient zero and let a
detached adapter pass), the gradients are checked to be non-zero, and every test first asserts that the base
really is in host memory (placement) and that the program fetches each streamed leaf inside the scan (jaxpr),
so a silently device-resident base fails. On CPU the host is ordinary RAM: `pinned_host` is a distinct memory
space of the CPU device (jit arguments carry it, `f32<host>`), and the in-jit copy lowers to a no-op, so the
GPU lowering is checked too (one annotate_device_placement per streamed leaf in the forward and the backward).
"""
import collections
import json

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from surojax.losses.lm import lm_loss
from surojax.models.config import ModelConfig
from surojax.models.decoder import Decoder, layer_pattern
from surojax.models.layer_runner import LayerScan, Recompute, with_runner
from surojax.offload.streaming import HOST_KIND, OffloadError, check_streamed, place_base_on_host, streamed_leaves
from surojax.peft.lora import LORA_TARGETS, TRAINABLE, apply_lora
from surojax.quant.model import quantize_model
from surojax.train.step import make_train_step

from tests.tiny import QWEN3, model_config
from tests.train.conftest import ROOT, tiny_config, write_instruction_data  # noqa: F401 (fixture)

CFG = model_config(QWEN3, vocab_size=128)
# the Qwen3.5 hybrid (Gated DeltaNet layers in `linear_layers`, gated attention layers in `layers`): both
# stacks stream, each layer fetched from its own stack in layer order; LoRA on every projection of both
# (two layers, [linear, full]: the fewest layer bodies to compile)
HYBRID = ModelConfig.from_hf({**json.loads((ROOT / "tests/fixtures/models/qwen3_5_text/config.json").read_text()),
                              "num_hidden_layers": 2, "layer_types": ["linear_attention", "full_attention"]})
A, B, T = 2, 2, 16


def _model(quant: str | None = None, cfg: ModelConfig = CFG):
    model = Decoder(cfg, rngs=nnx.Rngs(0))
    if quant:
        quantize_model(model, quant)
    apply_lora(model, rank=4, alpha=8, rngs=nnx.Rngs(1), targets="all-linear" if cfg is HYBRID else LORA_TARGETS)
    # vacuity guard: B = 0 makes every dL/dA zero and the adapter's output zero; randomise B
    keys = iter(jax.random.split(jax.random.key(2), 32))
    for path, var in nnx.to_flat_state(nnx.state(model, TRAINABLE)):
        if path[-1] == "lora_b":
            var.set_value(0.1 * jax.random.normal(next(keys), var.get_value().shape, var.get_value().dtype))
    return model


def _split(model):
    graphdef, trainable, frozen = nnx.split(model, TRAINABLE, ...)
    streamed = place_base_on_host(frozen, embedding=True)  # the tiny model's embedding is untied
    # the protocol's guard: the streamed base is in host memory, the resident one is not
    assert check_streamed(streamed) > 0
    assert set(streamed_leaves(streamed).values()) == {HOST_KIND}
    assert HOST_KIND not in set(streamed_leaves(frozen).values())
    assert streamed["embed"]["embedding"].get_value().sharding.memory_kind == HOST_KIND
    with pytest.raises(OffloadError):
        check_streamed(frozen)
    return graphdef, trainable, frozen, streamed


def _batch(accum=A, seed=0, vocab=CFG.vocab_size):
    rng = np.random.default_rng(seed)
    shape = (accum, B, T)
    return {"tokens": rng.integers(1, vocab, shape).astype(np.int32),
            "positions": np.broadcast_to(np.arange(T, dtype=np.int32), shape).copy(),
            "segment_ids": np.ones(shape, np.int32),
            "targets": rng.integers(1, vocab, shape).astype(np.int32),
            "loss_mask": (rng.random(shape) > 0.2).astype(np.float32)}


def _device_puts(jaxpr, space=jax.memory.Space.Device) -> int:
    """How many values the (nested) jaxpr's device_put equations move to `space` (Device or Host)."""
    n = 0
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "device_put" and space in eqn.params["devices"]:
            n += len(eqn.invars)
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
            n += _device_puts(sub, space)
    return n


def _fetches_per_pass(cfg: ModelConfig, streamed) -> int:
    """The streamed leaves one pass over the layers fetches, as the program holds them: each layer of the scanned
    group (the pattern's types) and of the remainder after it fetches its own stack's leaves (a one-type
    pattern: the stack's leaves once)."""
    pattern = layer_pattern(cfg)
    per_stack = collections.Counter(k.split(".")[0] for k in streamed_leaves(streamed))
    return sum(per_stack[t.stack] for t in pattern.types + pattern.types[:pattern.remainder])


def _max_diff(a, b) -> float:
    """Max abs difference over the leaves, in NumPy (no eager XLA op to compile per leaf shape)."""
    return max(float(np.max(np.abs(np.asarray(x, np.float32) - np.asarray(y, np.float32))))
               for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True))


@pytest.mark.parametrize("quant,recompute,cfg", [(None, "offload", CFG), ("nf4", "dots", CFG),
                                                 (None, "full", HYBRID)], ids=["offload", "nf4-dots", "hybrid"])
def test_streamed_logits_and_lora_grads_equal_resident(quant, recompute, cfg):
    graphdef, trainable, resident, streamed = _split(_model(quant, cfg))
    if cfg is HYBRID:  # both stacks stream: the DeltaNet layers' weights are in host memory too
        assert {k.split(".")[0] for k in streamed_leaves(streamed)} == {"layers", "linear_layers"}
    mb = {k: jnp.asarray(v[0]) for k, v in _batch(vocab=cfg.vocab_size).items()}
    loop = LayerScan(Recompute(recompute))

    def logits_loss_grads(tr, fr, loop=loop):
        logits = nnx.merge(graphdef, tr, fr)(mb["tokens"], mb["positions"], mb["segment_ids"])
        loss, grads = jax.value_and_grad(lambda t: lm_loss(with_runner(nnx.merge(graphdef, t, fr), loop), mb)[0])(tr)
        return logits, loss, grads

    # one compile: streamed, resident, and (for `offload`) resident under `full`, the policy it must equal
    full = LayerScan(Recompute.FULL)
    runs = jax.jit(lambda tr, s, r: (logits_loss_grads(tr, s), logits_loss_grads(tr, r),
                                     logits_loss_grads(tr, r, full) if recompute == "offload" else None))
    (lg_s, l_s, g_s), (lg_r, l_r, g_r), by_full = runs(trainable, streamed, resident)
    assert _max_diff(lg_s, lg_r) == 0.0
    assert float(l_s) == float(l_r)
    assert _max_diff(g_s, g_r) == 0.0
    if by_full is not None:  # recompute: offload computes exactly what recompute: full computes
        assert float(by_full[1]) == float(l_s) and _max_diff(by_full[2], g_s) == 0.0
    nonzero = [bool(np.abs(np.asarray(g)).max() > 0) for g in jax.tree.leaves(g_s)]
    # every A and B of every target moves (the hybrid: 7 projections in `layers`, 8 in `linear_layers`)
    assert len(nonzero) == 2 * (7 if cfg is CFG else 15) and all(nonzero)
    # the program fetches each streamed leaf in the forward and again in the backward recompute, and the embedding
    # table once per forward pass (offload: plus the layer input coming back from host memory); the resident
    # program fetches no weight
    n = _fetches_per_pass(cfg, streamed)
    assert _device_puts(jax.make_jaxpr(logits_loss_grads)(trainable, streamed).jaxpr) == \
        (n + 1) + (n + 1) + n + (recompute == "offload")
    assert _device_puts(jax.make_jaxpr(logits_loss_grads)(trainable, resident).jaxpr) == \
        (recompute == "offload")


def test_train_step_with_accumulation_equal():
    graphdef, trainable, resident, streamed = _split(with_runner(_model(), LayerScan(Recompute.FULL)))
    opt = optax.adamw(1e-2)
    step = make_train_step(graphdef, lm_loss, opt, jit=False)
    batch, key, opt_state = _batch(accum=A), jax.random.key(0), opt.init(trainable)
    both = jax.jit(lambda s, r: (step(trainable, s, opt_state, batch, key), step(trainable, r, opt_state, batch, key)))
    (p_s, _, m_s), (p_r, _, m_r) = both(streamed, resident)
    assert float(m_s["loss"]) == float(m_r["loss"]) and float(m_s["grad_norm"]) == float(m_r["grad_norm"]) > 0
    assert _max_diff(p_s, p_r) == 0.0
    assert _max_diff(p_s, trainable) > 0  # the update happened
    # the streamed argument of the compiled program is host-resident
    spaces = [str(getattr(a, "memory_space", "")) for a in both.trace(streamed, resident).jaxpr.in_avals]
    assert "MemorySpace.Host" in spaces


def test_gpu_lowering_moves_each_streamed_leaf_to_the_device_in_forward_and_backward():
    """The CPU lowering drops in-jit transfers; the CUDA lowering (no GPU needed) shows them."""
    graphdef, trainable, _, streamed = _split(_model())
    mb = {k: jnp.asarray(v[0]) for k, v in _batch().items()}

    def loss(tr, fr):
        return lm_loss(with_runner(nnx.merge(graphdef, tr, fr), LayerScan(Recompute.FULL)), mb)[0]

    try:
        text = jax.jit(jax.grad(loss)).trace(trainable, streamed).lower(lowering_platforms=("cuda",)).as_text()
    except Exception as e:  # noqa: BLE001 - a jax build without CUDA lowering rules
        pytest.skip(f"no CUDA lowering here: {e}")
    assert text.count("annotate_device_placement") == 2 * len(streamed_leaves(streamed)) + 1  # + the embedding
    assert 'mhlo.memory_kind = "pinned_host"' in text


def test_trainer_streamed_losses_equal_resident(tmp_path):
    """The Trainer path (fixture qwen3, LoRA with dropout, accumulation 2): offload_base_weights puts the base (and
    the untied embedding) in host memory, alone and with offload_prefetch; the prefetching Trainer's losses equal the
    resident Trainer's (the prefetching layer loop, tests/offload/test_prefetch.py). The plain streamed loop's
    steps are not run here: its bit-equality with the resident step is test_train_step_with_accumulation_equal's
    (the same make_train_step), the Trainer's host placement is asserted, and the Trainer's streamed step
    (host-resident frozen arguments, donation, the data path) runs with offload_prefetch."""
    from surojax.config import config_from_dict
    from surojax.train.trainer import Trainer

    data = [{"path": str(write_instruction_data(tmp_path / "inst.jsonl")), "type": "instruction"}]
    losses = {}
    for offload in (False, True, "prefetch"):
        cfg = config_from_dict(dict(
            model=str(ROOT / "tests" / "fixtures" / "models" / "qwen3"), output_dir=str(tmp_path / f"o{offload}"),
            recipe="fp32", recompute="full", lora=True, lora_rank=4, lora_alpha=8, lora_dropout=0.1, datasets=data,
            sequence_len=64, per_device_train_batch_size=2, gradient_accumulation_steps=2, learning_rate=1e-2,
            max_steps=3, offload_base_weights=bool(offload), offload_prefetch=offload == "prefetch"))
        trainer = Trainer(cfg)
        assert set(streamed_leaves(trainer.frozen).values()) == ({HOST_KIND} if offload else {"device"})
        embedding = trainer.frozen["embed"]["embedding"].get_value().sharding.memory_kind  # untied in this fixture
        assert embedding == (HOST_KIND if offload else "device")
        if offload is not True:
            losses[offload] = [trainer.step()["loss"] for _ in range(3)]
    assert losses["prefetch"] == losses[False]
    assert losses[False][-1] != losses[False][0]


def test_offload_base_needs_lora_and_recomputation(tiny_config):
    from surojax.config import config_from_dict
    from surojax.config.errors import ConfigError

    with pytest.raises(ConfigError, match="offload_base_weights"):
        config_from_dict(tiny_config(offload_base_weights=True, recompute="full"))
    with pytest.raises(ConfigError, match="recompute"):
        config_from_dict(tiny_config(lora=True, offload_base_weights=True, recompute="none"))
    with pytest.raises(ConfigError, match="offload_prefetch"):
        config_from_dict(tiny_config(lora=True, offload_prefetch=True, recompute="full"))
    with pytest.raises(ConfigError, match="recompute: full"):
        config_from_dict(tiny_config(lora=True, offload_base_weights=True, offload_prefetch=True, recompute="dots"))
