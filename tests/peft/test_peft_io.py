"""PEFT adapter folders: names and layout, round trip, accepted name variants, clear errors, atomic writes."""
from __future__ import annotations

import json
import shutil

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax import nnx

from peft_support import TINY, TOKENS, forward, randomize_adapter, tiny_model
from surojax.peft import peft_io
from surojax.peft.lora import TRAINABLE, apply_lora, lora_modules
from surojax.peft.peft_io import AdapterError, load_peft_adapter, save_peft_adapter
from surojax.peft.stacked import load_adapter_into
from surojax.weights.safetensors_file import SafetensorsFile, write_safetensors

PREFIX = "base_model.model.model.layers"


def _adapted(family="llama", **kw):
    model = apply_lora(tiny_model(family), rank=4, alpha=8.0, rngs=nnx.Rngs(3), **kw)
    randomize_adapter(model)
    return model


@pytest.fixture
def saved(tmp_path):
    model = _adapted(targets=("q_proj", "v_proj", "down_proj"), use_rslora=True, dropout=0.05)
    return model, save_peft_adapter(model, tmp_path / "adapter", "org/tiny-llama")


def _rewrite(adapter_dir, rename=lambda n: n, drop=(), change=None):
    f = SafetensorsFile(adapter_dir / "adapter_model.safetensors")
    tensors = {rename(n): np.array(f.get(n)) for n in f.names() if n not in drop}
    if change:
        tensors.update(change)
    write_safetensors(adapter_dir / "adapter_model.safetensors", tensors)


def _edit_config(adapter_dir, **changes):
    p = adapter_dir / "adapter_config.json"
    p.write_text(json.dumps({**json.loads(p.read_text()), **changes}))


def test_folder_layout_names_and_config(saved):
    model, out = saved
    assert sorted(p.name for p in out.iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]
    cfg = json.loads((out / "adapter_config.json").read_text())
    assert cfg["peft_type"] == "LORA" and cfg["task_type"] == "CAUSAL_LM" and cfg["bias"] == "none"
    assert (cfg["r"], cfg["lora_alpha"], cfg["lora_dropout"], cfg["use_rslora"]) == (4, 8, 0.05, True)
    assert cfg["target_modules"] == ["q_proj", "v_proj", "down_proj"] and cfg["fan_in_fan_out"] is False
    assert cfg["base_model_name_or_path"] == "org/tiny-llama" and cfg["use_dora"] is False
    f = SafetensorsFile(out / "adapter_model.safetensors")
    cfg_m = TINY["llama"]
    assert len(f.names()) == 3 * cfg_m.num_layers * 2
    q = lora_modules(model)["q_proj"]
    for i in range(cfg_m.num_layers):
        a = f.get(f"{PREFIX}.{i}.self_attn.q_proj.lora_A.weight")
        b = f.get(f"{PREFIX}.{i}.self_attn.q_proj.lora_B.weight")
        assert a.shape == (4, cfg_m.hidden_size) and b.shape == (cfg_m.q_dim, 4)  # torch layout [R, in], [out, R]
        assert np.array_equal(a, np.asarray(q.lora_a[...][i]).T) and np.array_equal(b, np.asarray(q.lora_b[...][i]).T)
    assert f.get(f"{PREFIX}.1.mlp.down_proj.lora_A.weight").shape == (4, cfg_m.intermediate_size)



def test_base_path_is_recorded_absolute_and_a_repo_id_as_given(tmp_path, monkeypatch):
    """As PEFT does: an existing local base path is stored absolute (the adapter loads from any directory);
    a hub repo id (no such local path) is kept as written."""
    model = _adapted()
    (tmp_path / "models" / "base").mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    for base, want in (("models/base", str(tmp_path / "models" / "base")),
                       ("./models/../models/base", str(tmp_path / "models" / "base")),
                       ("org/tiny-llama", "org/tiny-llama")):
        out = save_peft_adapter(model, tmp_path / "out", base, overwrite=True)
        assert json.loads((out / "adapter_config.json").read_text())["base_model_name_or_path"] == want, base
        assert load_peft_adapter(out).base_model_name_or_path == want

@pytest.mark.parametrize("trainable", [True, False])
def test_round_trip(saved, trainable):
    model, out = saved
    want = forward(model, TOKENS)
    loaded = load_adapter_into(tiny_model(), out, trainable=trainable)
    if trainable:  # the same adapter, bit for bit, computing the same thing
        assert jnp.array_equal(forward(loaded, TOKENS), want)
        a, b = nnx.to_flat_state(nnx.state(model, TRAINABLE)), nnx.to_flat_state(nnx.state(loaded, TRAINABLE))
        assert [p for p, _ in a] == [p for p, _ in b]
        assert all(jnp.array_equal(u.get_value(), v.get_value()) for (_, u), (_, v) in zip(a, b))
        mod = lora_modules(loaded)["v_proj"]
        assert (mod.rank, mod.alpha, mod.use_rslora, mod.dropout) == (4, 8.0, True, 0.05)
    else:  # folded into the base: same logits up to rounding (x (W + sAB) vs xW + s(xA)B)
        assert not lora_modules(loaded)
        np.testing.assert_allclose(forward(loaded, TOKENS), want, rtol=0, atol=1e-5)
    ad = load_peft_adapter(out)
    assert ad.spec.targets == ("q_proj", "v_proj", "down_proj") and ad.base_model_name_or_path == "org/tiny-llama"


def test_bf16_save_and_all_families(tmp_path):
    for family in TINY:
        model = _adapted(family)
        out = save_peft_adapter(model, tmp_path / family, None, dtype=jnp.bfloat16)
        f = SafetensorsFile(out / "adapter_model.safetensors")
        assert {f.dtype(n) for n in f.names()} == {np.dtype(ml_dtypes.bfloat16)}
        loaded = load_adapter_into(tiny_model(family), out, trainable=True)
        assert lora_modules(loaded)["o_proj"].lora_a.get_value().dtype == jnp.float32
        want = forward(model, TOKENS)
        np.testing.assert_allclose(forward(loaded, TOKENS), want, atol=2e-2)  # bf16 rounding of A and B


def test_name_variants_load_the_same(saved):
    model, out = saved
    want = load_peft_adapter(out).weights
    for rename in (lambda n: n.replace(".weight", ".default.weight"),  # PEFT's in-memory names
                   lambda n: n.removeprefix("base_model.model.")):  # no wrapper prefix
        d = out.parent / f"variant{id(rename)}"
        shutil.copytree(out, d)
        _rewrite(d, rename)
        got = load_peft_adapter(d).weights
        assert all(np.array_equal(got[t][k], want[t][k]) for t in want for k in (0, 1))


def test_missing_tensor_is_named(saved):
    _, out = saved
    name = f"{PREFIX}.1.self_attn.v_proj.lora_B.weight"
    _rewrite(out, drop=(name,))
    with pytest.raises(AdapterError, match=rf"adapter_model.safetensors: missing tensors \(1\): {name}"):
        load_peft_adapter(out)


def test_shape_mismatch_names_both_shapes(saved, tmp_path):
    _, out = saved
    name = f"{PREFIX}.1.self_attn.q_proj.lora_A.weight"
    _rewrite(out, change={name: np.zeros((4, 48), np.float32)})
    with pytest.raises(AdapterError, match=rf"{name} has shape \[4, 48\], layer 0 has \[4, 32\]"):
        load_peft_adapter(out)
    with pytest.raises(AdapterError, match=rf"{name} has shape \[4, 48\], the model needs \[4, 32\]"):
        load_adapter_into(tiny_model(), out, trainable=True)
    _rewrite(out, change={name: np.zeros((4, 32, 1), np.float32)})
    with pytest.raises(AdapterError, match=rf"{name} has shape \[4, 32, 1\], expected a matrix"):
        load_peft_adapter(out)
    # An adapter for another model: self-consistent, but not this model's depth or dimensions.
    d = save_peft_adapter(_adapted("qwen3"), tmp_path / "qwen3", None)  # 3 layers
    with pytest.raises(AdapterError, match=r"tensors outside the adapter \(the model has 2 layers\): .*layers\.2\."):
        load_adapter_into(tiny_model("llama"), d, trainable=True)
    wide = tiny_model("llama")
    wide.layers.mlp.gate_proj.out_features = 50  # pretend a wider MLP
    d2 = save_peft_adapter(_adapted(targets=["gate_proj"]), tmp_path / "gate", None)
    with pytest.raises(AdapterError, match=r"gate_proj.lora_B.weight has shape \[48, 4\], the model needs \[50, 4\]"):
        load_adapter_into(wide, d2, trainable=False)


def test_rank_mismatch_with_config(saved):
    _, out = saved
    _edit_config(out, r=8)
    msg = r"lora_A.weight has shape \[4, 32\], adapter_config.json has r=8, so it should be \[8, 32\]"
    with pytest.raises(AdapterError, match=msg):
        load_peft_adapter(out)


@pytest.mark.parametrize("change, msg", [
    ({"peft_type": "IA3"}, "peft_type 'IA3' is not supported"),
    ({"use_dora": True}, "unsupported LoRA options: use_dora=True"),
    ({"bias": "lora_only"}, "bias='lora_only'"),
    ({"rank_pattern": {"q_proj": 8}}, "rank_pattern"),
    ({"modules_to_save": ["lm_head"]}, "modules_to_save"),
    ({"layers_to_transform": [0]}, "layers_to_transform"),
    ({"fan_in_fan_out": True}, "fan_in_fan_out=True"),
    ({"target_modules": ["q_proj", "lm_head"]}, r"target_modules \['lm_head'\] are not supported"),
    ({"target_modules": ["q_proj", "v_proj"]}, r"tensors outside the adapter .*down_proj"),
    ({"target_modules": ["q_proj", "v_proj", "down_proj", "k_proj"]}, r"missing tensors \(4\): .*k_proj"),
    ({"r": "four"}, "needs numeric r and lora_alpha"),
])
def test_unsupported_config_is_refused(saved, change, msg):
    _, out = saved
    _edit_config(out, **change)
    with pytest.raises(AdapterError, match=msg) as e:
        load_peft_adapter(out)
    assert str(out) in str(e.value)


def test_regex_target_modules_use_the_tensors(saved):
    _, out = saved
    _edit_config(out, target_modules=".*(q_proj|v_proj|down_proj)")
    assert load_peft_adapter(out).spec.targets == ("q_proj", "v_proj", "down_proj")


def test_unexpected_tensor_and_missing_files(saved, tmp_path):
    _, out = saved
    _rewrite(out, change={"base_model.model.lm_head.lora_A.weight": np.zeros((4, 32), np.float32)})
    with pytest.raises(AdapterError, match=r"unexpected tensors \(1\): base_model.model.lm_head.lora_A.weight"):
        load_peft_adapter(out)
    (out / "adapter_model.safetensors").rename(out / "adapter_model.bin")
    with pytest.raises(AdapterError, match="no adapter_model.safetensors .*adapter_model.bin"):
        load_peft_adapter(out)
    with pytest.raises(AdapterError, match="no adapter_config.json"):
        load_peft_adapter(tmp_path)


def test_writes_are_atomic_and_never_clobber(saved, monkeypatch):
    model, out = saved
    before = (out / "adapter_model.safetensors").read_bytes()
    with pytest.raises(AdapterError, match="exists and is not empty"):
        save_peft_adapter(model, out, None)
    with pytest.raises(AdapterError, match="no LoRA adapter"):
        save_peft_adapter(tiny_model(), out.parent / "plain", None)

    def boom(*a, **k):
        raise OSError("disk full")

    monkeypatch.setattr(peft_io, "write_safetensors", boom)
    with pytest.raises(OSError, match="disk full"):
        save_peft_adapter(model, out, None, overwrite=True)
    assert (out / "adapter_model.safetensors").read_bytes() == before  # old folder intact
    assert sorted(p.name for p in out.parent.iterdir()) == ["adapter"]  # no temp folder left behind
    monkeypatch.undo()
    (out.parent / "empty").mkdir()
    save_peft_adapter(model, out.parent / "empty", None)  # an empty folder is fine
    save_peft_adapter(model, out, None, overwrite=True)


def test_adapter_folder_has_the_umask_mode(saved, tmp_path):
    """Not mkdtemp's 0700: the folder gets the mode a plain mkdir gives (0755 under umask 022)."""
    _, out = saved
    (tmp_path / "probe").mkdir()
    assert out.stat().st_mode & 0o777 == (tmp_path / "probe").stat().st_mode & 0o777
