"""The training config: schema, error messages, overrides, cross-field rules, path checks."""
from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from surojax.config import (
    ConfigError, TrainConfig, apply_overrides, check_paths, config_from_dict, load_config,
)

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "configs" / "examples" / "lora_qwen3.yaml"
BASE = {"model": "m", "datasets": [{"path": "d.jsonl"}]}


def write(tmp_path: Path, text: str, name: str = "cfg.yaml") -> Path:
    p = tmp_path / name
    p.write_text(textwrap.dedent(text).lstrip())
    return p


def errors_of(d: dict) -> ConfigError:
    with pytest.raises(ConfigError) as e:
        config_from_dict({**BASE, **d})
    return e.value


def one_error(d: dict) -> tuple[str, str]:
    err = errors_of(d)
    assert len(err.problems) == 1, str(err)
    return err.problems[0].key, str(err)


# --- the example and defaults

def test_example_validates():
    cfg = load_config(EXAMPLE)
    assert cfg.lora and cfg.qlora_bnb and cfg.is_qlora
    assert cfg.lora_target_modules == ["all-linear"]  # resolved against the model when LoRA is applied
    assert cfg.learning_rate == 2e-4 and isinstance(cfg.adam_epsilon, float) and cfg.adam_epsilon == 1e-8
    assert [d.type for d in cfg.datasets] == ["conversation", "instruction"]
    assert cfg.parallel.sizes() == {"data": -1, "fsdp": 1, "tensor": 1, "expert": 1, "stage": 1}
    assert cfg.report_to == ["jsonl", "tensorboard"]


def test_minimal_defaults():
    cfg = config_from_dict(BASE)
    assert (cfg.recipe, cfg.lora, cfg.lora_rank, cfg.lora_alpha, cfg.sample_packing) == ("bf16", False, 16, 32, True)
    assert cfg.num_epochs == 1 and cfg.max_steps is None
    assert cfg.datasets[0].type == "auto" and cfg.datasets[0].split == "train"


def test_a_dataset_path_alone_is_its_entry():
    """`datasets: org/name` (the quickstarts' one-liner) and plain strings in the list are entries with that path."""
    cfg = config_from_dict({"model": "m", "datasets": "mlabonne/FineTome-100k",
                            "validation_datasets": ["v.jsonl", {"path": "w.jsonl", "type": "text"}]})
    assert [d.path for d in cfg.datasets] == ["mlabonne/FineTome-100k"] and cfg.datasets[0].type == "auto"
    assert [(d.path, d.type) for d in cfg.validation_datasets] == [("v.jsonl", "auto"), ("w.jsonl", "text")]
    key, msg = one_error({"datasets": 3})
    assert key == "datasets" and "list" in msg


def test_dump_round_trips_by_yaml_key():
    cfg = config_from_dict({**BASE, "from_scratch": True, "model_config": {"hidden_size": 64}, "model": None})
    dumped = cfg.model_dump()
    assert dumped["model_config"] == {"hidden_size": 64} and "model_config_overrides" not in dumped
    assert config_from_dict(dumped) == cfg


def test_config_is_frozen():
    cfg = config_from_dict(BASE)
    with pytest.raises(Exception):
        cfg.learning_rate = 1.0  # type: ignore[misc]


# --- unknown keys

def test_unknown_top_level_key_names_closest():
    key, msg = one_error({"learning_rat": 1e-4})
    assert key == "learning_rat"
    assert "unknown key" in msg and "'learning_rate'" in msg


def test_unknown_nested_key_names_path_and_closest():
    key, msg = one_error({"datasets": [{"path": "a"}, {"path": "b", "tpye": "text"}]})
    assert key == "datasets[1].tpye"
    assert "datasets[1].tpye" in msg and "did you mean 'type'" in msg


def test_unknown_key_in_parallel_section():
    key, msg = one_error({"parallel": {"fdsp": 2}})
    assert key == "parallel.fdsp" and "'fsdp'" in msg


def test_renamed_axolotl_key_gets_a_hint():
    _, msg = one_error({"micro_batch_size": 2})
    assert "per_device_train_batch_size" in msg


# --- bad values

def test_bad_enum_names_key_value_and_choices():
    key, msg = one_error({"recipe": "bf17"})
    assert key == "recipe"
    assert "'bf17'" in msg
    for choice in ("bf16", "fp32", "fp8_hybrid", "nvfp4"):
        assert choice in msg


def test_bad_nested_enum():
    key, msg = one_error({"datasets": [{"path": "a", "type": "chat"}]})
    assert key == "datasets[0].type"
    assert "'chat'" in msg and "conversation" in msg and "preference" in msg


def test_bad_number_and_bound():
    key, msg = one_error({"learning_rate": "fast"})
    assert key == "learning_rate" and "'fast'" in msg and "number" in msg
    key, msg = one_error({"sequence_len": 0})
    assert key == "sequence_len" and "greater than 0" in msg


def test_lora_target_modules():
    assert config_from_dict({**BASE, "lora": True, "lora_target_modules": "q_proj,v_proj"}).lora_target_modules == [
        "q_proj", "v_proj"]
    key, msg = one_error({"lora": True, "lora_target_modules": ["q_proj", "qkv"]})
    assert key == "lora_target_modules" and "'qkv'" in msg and "all-linear" in msg


def test_several_errors_reported_together():
    err = errors_of({"recipe": "bf17", "lora_rnk": 8, "datasets": [{"path": "a", "tpye": "text"}], "seed": "x"})
    assert sorted(err.keys) == sorted(["recipe", "lora_rnk", "datasets[0].tpye", "seed"])
    assert len(str(err).splitlines()) == 4


def test_message_has_no_pydantic_wall():
    msg = str(errors_of({"recipe": "bf17", "lora_rnk": 8}))
    for noise in ("pydantic", "validation error", "For further information", "type="):
        assert noise not in msg


# --- YAML

def test_yaml_syntax_error_names_file_line_and_column(tmp_path):
    p = write(tmp_path, """
        model: m
        datasets:
          - path: a
        learning_rate: [1e-4
        seed: 3
    """, "broken.yaml")
    with pytest.raises(ConfigError) as e:
        load_config(p)
    msg = str(e.value)
    assert str(p) in msg and "YAML syntax error" in msg
    assert e.value.problems[0].line is not None and f"{p}:{e.value.problems[0].line}:" in msg
    assert len(msg.splitlines()) == 1


def test_yaml_duplicate_key_is_an_error(tmp_path):
    p = write(tmp_path, """
        model: m
        datasets: [{path: a}]
        seed: 1
        seed: 2
    """)
    with pytest.raises(ConfigError, match=r"cfg.yaml:4:1: .*duplicate key 'seed'"):
        load_config(p)


def test_schema_errors_carry_the_yaml_line(tmp_path):
    p = write(tmp_path, """
        model: m
        datasets:
          - path: a
            tpye: text
        recipe: bf17
    """)
    with pytest.raises(ConfigError) as e:
        load_config(p)
    lines = {pr.key: pr.line for pr in e.value.problems}
    assert lines == {"datasets[0].tpye": 4, "recipe": 5}
    assert f"{p}:4:5: datasets[0].tpye" in str(e.value)


def test_missing_file_and_non_mapping(tmp_path):
    with pytest.raises(ConfigError, match="cannot read"):
        load_config(tmp_path / "nope.yaml")
    with pytest.raises(ConfigError, match="top level must be a mapping"):
        load_config(write(tmp_path, "- a\n- b\n"))


def test_yaml_exponent_floats_are_floats(tmp_path):
    p = write(tmp_path, """
        from_scratch: true
        model_config: {hidden_size: 64, rms_norm_eps: 1e-6}
        datasets: [{path: a}]
        learning_rate: 3e-4
    """)
    cfg = load_config(p)
    assert cfg.model_config_overrides == {"hidden_size": 64, "rms_norm_eps": 1e-6}
    assert cfg.learning_rate == 3e-4


# --- overrides

def test_overrides(tmp_path):
    cfg = load_config(EXAMPLE, ["learning_rate=1e-4", "datasets.0.path=x.jsonl", "parallel.fsdp=2",
                                "parallel.data=1", "lora_target_modules=[q_proj, v_proj]", "sample_packing=false",
                                "datasets.2.path=new.jsonl", "chat_template={% for m in messages %}"])
    assert cfg.learning_rate == 1e-4
    assert cfg.datasets[0].path == "x.jsonl" and cfg.datasets[0].type == "conversation"
    assert cfg.datasets[2].path == "new.jsonl"
    assert (cfg.parallel.fsdp, cfg.parallel.data) == (2, 1)
    assert cfg.lora_target_modules == ["q_proj", "v_proj"]
    assert cfg.sample_packing is False
    assert cfg.chat_template == "{% for m in messages %}"  # not YAML on its own: taken as a string


def test_override_creates_missing_sections():
    d = apply_overrides({"model": "m"}, ["parallel.tensor=2", "datasets.0.path=a"])
    assert d == {"model": "m", "parallel": {"tensor": 2}, "datasets": [{"path": "a"}]}


def test_bad_overrides():
    with pytest.raises(ConfigError, match="key=value"):
        apply_overrides({}, ["learning_rate"])
    with pytest.raises(ConfigError, match=r"datasets\[5\].*out of range"):
        apply_overrides({"datasets": [{"path": "a"}]}, ["datasets.5.path=x"])
    with pytest.raises(ConfigError) as e:
        load_config(EXAMPLE, ["learning_rat=1e-4", "recipe=fp7"])
    assert sorted(e.value.keys) == ["learning_rat", "recipe"]
    assert "'learning_rate'" in str(e.value) and "set by --override" in str(e.value)


# --- cross-field rules (each message names the key it is about)

@pytest.mark.parametrize("d, key, words", [
    ({"warmup_steps": 10, "warmup_ratio": 0.1}, "warmup_steps", "not both"),
    ({"lora": True, "qlora_bnb": True, "qlora_fp8": True}, "qlora_bnb", "at most one"),
    ({"lora": True, "qlora_fp4": True, "qlora_gguf": "q4_k"}, "qlora_fp4", "at most one"),
    ({"qlora_bnb": True}, "qlora_bnb", "lora: true"),
    ({"lora_rank": 8}, "lora_rank", "lora: true"),
    ({"lora_target_modules": ["q_proj"]}, "lora_target_modules", "lora: true"),
    ({"lora": True, "qlora_bnb_block_size": 128}, "qlora_bnb_block_size", "qlora_bnb"),
    ({"lora": True, "qlora_block_size": 64}, "qlora_block_size", "qlora_fp8"),
    ({"lora": True, "adapter_init_mode": "merge"}, "adapter_init_mode", "adapter_path"),
    ({"adapter_path": "a", "adapter_init_mode": "trainable"}, "adapter_init_mode", "lora: true"),
    ({"model": None}, "model", "required"),
    ({"model": None, "from_scratch": True}, "model_config", "from_scratch needs"),
    ({"model_config": {"hidden_size": 8}}, "model_config", "from_scratch"),
    ({"from_scratch": True, "lora": True}, "from_scratch", "lora"),
    ({"num_epochs": None}, "max_steps", "max_steps or num_epochs"),
    ({"cooldown_steps": 10}, "cooldown_steps", "wsd"),
    ({"max_steps": 10, "warmup_steps": 8, "lr_scheduler_type": "wsd", "cooldown_steps": 5}, "warmup_steps", "exceed"),
    ({"save_total_limit": 2}, "save_total_limit", "save_steps"),
    ({"validation_datasets": [{"path": "v"}], "validation_split_ratio": 0.1}, "validation_split_ratio", "not both"),
    ({"eval_steps": 10}, "eval_steps", "validation"),
    ({"max_model_len": 1024, "sequence_len": 2048}, "sequence_len", "max_model_len"),
    ({"parallel": {"data": -1, "fsdp": -1}}, "parallel", "at most one"),
    ({"datasets": [{"path": "d.jsonl", "prompt_field": "question"}]}, "datasets.0.prompt_field", "trainer: dpo"),
    ({"beta": 0.2}, "beta", "trainer: dpo"),
    ({"trainer": "dpo", "loss_type": "ipo", "label_smoothing": 0.1}, "label_smoothing", "sigmoid only"),
    ({"trainer": "dpo", "datasets": [{"path": "d.jsonl", "type": "text"}]}, "datasets.0.type", "preference"),
])
def test_cross_field_rule(d, key, words):
    k, msg = one_error(d)
    assert k == key and words in msg, msg


@pytest.mark.parametrize("d,key", [
    ({"optimizer": "normuon"}, "optimizer"),
    ({"gradient_dtype": "fp32"}, "gradient_dtype"),  # fp32 activation gradients under recipe bf16
    ({"sequence_chunks": 4}, "sequence_chunks"),
    ({"long_context": True}, "long_context"),
    ({"offload_grads": True}, "offload_grads"),
    ({"lora": True, "qlora_bnb": True, "qlora_bnb_block_size": 128}, "qlora_bnb_block_size"),
    ({"lora": True, "qlora_fp8": True, "qlora_block_size": 64}, "qlora_block_size"),
])
def test_keys_whose_feature_is_not_built_are_refused_by_name(d, key):
    k, msg = one_error(d)
    assert k == key and "not available" in msg, msg


@pytest.mark.parametrize("spelling,fmt", [({"qlora_bnb": True}, "nf4"), ({"qlora_fp8": True}, "fp8"),
                                          ({"qlora_fp4": True}, "nvfp4"), ({"qlora_gguf": "q4_k"}, "q4_k"),
                                          ({"qlora": "q8_0"}, "q8_0")])
def test_qlora_spellings_are_one_choice(spelling, fmt):
    cfg = config_from_dict({**BASE, "lora": True, **spelling})
    assert cfg.qlora == fmt and cfg.is_qlora
    k, msg = one_error({"lora": True, "qlora": "nf4", "qlora_fp8": True})
    assert "at most one" in msg


@pytest.mark.parametrize("d", [
    {"lora": True, "qlora_bnb": True, "qlora_bnb_double_quant": False},
    {"lora": True, "qlora_fp8": True},
    {"lora": True, "qlora": "q4_k_m"},
    {"lora": True, "adapter_path": "a", "adapter_init_mode": "trainable"},
    {"adapter_path": "a", "adapter_init_mode": "merge"},  # merge, then full fine-tuning
    {"model": None, "from_scratch": True, "model_config": {"hidden_size": 8}},
    {"from_scratch": True},  # model's config.json, checked by check_paths
    {"num_epochs": None, "max_steps": 100, "warmup_ratio": 0.1},
    {"max_steps": -1},  # -1 means unset (HF style); num_epochs stays
    {"lr_scheduler_type": "wsd", "cooldown_steps": 10},
    {"validation_split_ratio": 0.1, "eval_steps": 10},
    {"lora_rank": 16},  # writing a default explicitly is harmless
    {"parallel": {"data": 2, "fsdp": -1, "tensor": 2}},
])
def test_cross_field_rules_allow(d):
    config_from_dict({**BASE, **d})


def test_cross_field_problems_reported_together():
    err = errors_of({"warmup_steps": 1, "warmup_ratio": 0.1, "lora_rank": 8, "eval_steps": 5})
    assert sorted(err.keys) == ["eval_steps", "lora_rank", "warmup_steps"]


def test_parallel_axis_values():
    key, msg = one_error({"parallel": {"tensor": 0}})
    assert key == "parallel.tensor" and "-1" in msg


def test_warmup_steps_for():
    assert config_from_dict({**BASE, "warmup_ratio": 0.1}).warmup_steps_for(1000) == 100
    assert config_from_dict({**BASE, "warmup_steps": 7}).warmup_steps_for(1000) == 7
    assert config_from_dict(BASE).warmup_steps_for(1000) == 0


# --- paths

def test_check_paths_names_missing_keys(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # the cache only (tests/test_hub.py fetches from a stand-in Hub)
    cfg = config_from_dict({"model": "org/absent", "datasets": [{"path": str(tmp_path / "d.jsonl")}],
                            "validation_datasets": [{"path": "./data/valid.jsonl"}], "lora": True,
                            "adapter_path": str(tmp_path)})
    with pytest.raises(ConfigError) as e:
        check_paths(cfg)
    assert e.value.keys == ["model", "adapter_path", "datasets[0].path", "validation_datasets[0].path"]
    assert "not in the cache" in str(e.value) and "adapter_config.json" in str(e.value)
    assert "is not a Hugging Face Hub dataset id" in str(e.value)


def test_check_paths_ok_and_hf_cache(tmp_path, monkeypatch):
    hub = tmp_path / "hub"
    snap = hub / "models--org--tiny" / "snapshots" / "abc"
    snap.mkdir(parents=True)
    (snap / "config.json").write_text("{}")
    (hub / "models--org--tiny" / "refs").mkdir()
    (hub / "models--org--tiny" / "refs" / "main").write_text("abc")
    monkeypatch.setenv("HF_HUB_CACHE", str(hub))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    data = tmp_path / "d.jsonl"
    data.write_text("{}\n")
    check_paths(config_from_dict({"model": "org/tiny", "datasets": [{"path": str(data)}]}))


def test_from_scratch_model_needs_config_json(tmp_path):
    (tmp_path / "d.jsonl").write_text("")
    cfg = config_from_dict({"model": str(tmp_path), "from_scratch": True, "datasets": [{"path": str(tmp_path)}]})
    with pytest.raises(ConfigError, match="model: .*config.json"):
        check_paths(cfg)


def test_schema_does_not_check_paths():
    assert isinstance(config_from_dict({"model": "/does/not/exist", "datasets": [{"path": "/nope"}]}), TrainConfig)


def test_optimizer_layerwise_is_refused_where_the_in_place_update_cannot_run():
    """optimizer_layerwise (full fine-tuning's in-place per-layer update) is read for full fine-tuning and refused
    with LoRA, with the loss guard's learning-rate cuts and with a parameter split, naming the keys."""
    assert config_from_dict({**BASE, "lora": False, "optimizer_layerwise": True}).optimizer_layerwise
    for extra, keys in (({"lora": True}, "lora"), ({"lora": False, "auto_lr_reduction": True}, "auto_lr_reduction"),
                        ({"lora": False, "parallel": {"fsdp": 2}}, "parallel")):
        err = str(errors_of({"optimizer_layerwise": True, **extra}))
        assert "optimizer_layerwise" in err and keys in err.lower(), err
