"""Multi-stage configs: merge of shared defaults, validation of every stage up front (errors name the stage),
paths that an earlier stage writes, overrides, output_dir handling, and a 2-step-per-stage smoke run."""
from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest
import yaml

from surojax.config import ConfigError, load_config
from surojax.config.stages import load_run, load_stages, merge_defaults
from surojax.train.stages import clear_output_dir, run_stages

ROOT = Path(__file__).resolve().parents[2]
QUICKSTART = ROOT / "configs" / "quickstart.yaml"
TOKENIZER = ROOT / "tests" / "fixtures" / "tokenizer"
TINY = {"model_type": "qwen3", "vocab_size": 512, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
        "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 16, "max_position_embeddings": 128}


def write(tmp_path: Path, text: str, name: str = "stages.yaml") -> Path:
    p = tmp_path / name
    p.write_text(textwrap.dedent(text).lstrip())
    return p


@pytest.fixture
def data(tmp_path):
    text = tmp_path / "text.jsonl"
    text.write_text("".join(json.dumps({"text": f"Tom has {i} apples. He buys 2 more. Now he has {i + 2}."}) + "\n"
                            for i in range(40)))
    qa = tmp_path / "qa.jsonl"
    qa.write_text("".join(json.dumps({"instruction": f"What is {i} + 2?", "output": str(i + 2)}) + "\n"
                          for i in range(24)))
    return text, qa


def two_stages(tmp_path, data, lora_extra: str = "", top_extra: str = "") -> Path:
    text, qa = data
    return write(tmp_path, f"""
        tokenizer: {TOKENIZER}
        recipe: fp32
        recompute: none
        learning_rate: 1e-3
        sequence_len: 64
        report_to: []
        model_config: {json.dumps(TINY)}
        {top_extra}
        stages:
          - name: pretrain
            from_scratch: true
            model_config: {{hidden_size: 48, head_dim: 24}}
            datasets: [{{path: {text}, type: text}}]
            max_steps: 2
            output_dir: {tmp_path}/out/pretrain
          - name: lora
            model: {tmp_path}/out/pretrain/model
            model_config: null
            lora: true
            lora_rank: 4
            learning_rate: 5e-3
            datasets: [{{path: {qa}, type: instruction}}]
            max_steps: 2
            output_dir: {tmp_path}/out/lora
            {lora_extra}
        """)


# ---- merging ----------------------------------------------------------------------------------------------------

def test_merge_defaults_merges_mappings_and_replaces_the_rest():
    shared = {"lr": 1, "m": {"a": 1, "b": 2}, "ds": [1, 2]}
    assert merge_defaults(shared, {"m": {"b": 3}, "ds": [9]}) == {"lr": 1, "m": {"a": 1, "b": 3}, "ds": [9]}
    assert merge_defaults(shared, {"m": None}) == {"lr": 1, "m": None, "ds": [1, 2]}
    assert shared == {"lr": 1, "m": {"a": 1, "b": 2}, "ds": [1, 2]}  # not modified


def test_shared_defaults_merge_under_each_stage(tmp_path, data):
    pre, lora = load_stages(two_stages(tmp_path, data))
    assert (pre.name, pre.index, lora.name, lora.index) == ("pretrain", 0, "lora", 1)
    assert pre.config.learning_rate == 1e-3 and lora.config.learning_rate == 5e-3  # the stage's own value wins
    assert pre.config.recipe == lora.config.recipe == "fp32"
    assert pre.config.model_config_overrides == {**TINY, "hidden_size": 48, "head_dim": 24}  # merged key by key
    assert lora.config.model_config_overrides is None
    assert [d.type for d in lora.config.datasets] == ["instruction"]  # lists are replaced


def test_overrides_reach_one_stage_or_all(tmp_path, data):
    pre, lora = load_stages(two_stages(tmp_path, data), ["stages.1.lora_rank=8", "max_steps=7"])
    assert lora.config.lora_rank == 8
    assert pre.config.max_steps == lora.config.max_steps == 7  # a top-level override wins over the stages' own


def test_a_plain_config_is_one_stage_as_before(tmp_path, data):
    text, _ = data
    p = write(tmp_path, f"""
        from_scratch: true
        tokenizer: {TOKENIZER}
        model_config: {json.dumps(TINY)}
        datasets: [{{path: {text}, type: text}}]
        max_steps: 2
        """, "plain.yaml")
    (stage,) = load_run(p, ["learning_rate=1e-4"])
    assert stage.name is None and stage.index is None and not stage.overwrite_output_dir
    assert stage.config == load_config(p, ["learning_rate=1e-4"])
    with pytest.raises(ConfigError, match="stages: this config has no `stages:` list"):
        load_stages(p)


# ---- validation -------------------------------------------------------------------------------------------------

def test_errors_name_the_stage_and_line(tmp_path, data):
    p = two_stages(tmp_path, data, lora_extra="lora_alpah: 8")
    text = p.read_text().replace("lora_rank: 4", "lora_rank: 0")
    p.write_text(text)
    with pytest.raises(ConfigError) as e:
        load_stages(p)
    line = text.splitlines().index("    lora_rank: 0") + 1
    assert e.value.keys == ["stages[1].lora_rank", "stages[1].lora_alpah"]
    msg = str(e.value)
    assert f"{p}:{line}:5: stages[1].lora_rank: " in msg and "(stage 'lora')" in msg
    assert "did you mean 'lora_alpha'?" in msg


def test_every_stage_is_validated_before_any_runs(tmp_path, data):
    # The first stage is broken by a cross-field rule; the second by a bad value: both are reported at once.
    p = two_stages(tmp_path, data, lora_extra="recipe: fp64")
    p.write_text(p.read_text().replace("from_scratch: true", "from_scratch: true\n    lora: true"))
    with pytest.raises(ConfigError) as e:
        load_stages(p)
    assert e.value.keys == ["stages[0].from_scratch", "stages[1].recipe"]
    assert not (tmp_path / "out").exists()


def test_stage_names_and_output_dirs_must_differ(tmp_path, data):
    p = two_stages(tmp_path, data)
    p.write_text(p.read_text().replace("name: lora", "name: pretrain"))
    with pytest.raises(ConfigError, match=r"stages\[1\]\.name: 'pretrain' is already the name of stages\[0\]"):
        load_stages(p)
    p = two_stages(tmp_path, data)
    p.write_text(p.read_text().replace("out/lora", "out/pretrain"))
    with pytest.raises(ConfigError, match=r"stages\[1\]\.output_dir: .* is also the output_dir of stage 'pretrain'"):
        load_stages(p)
    with pytest.raises(ConfigError, match=r"stages: must be a non-empty list"):
        load_stages(write(tmp_path, "stages: []\n", "empty.yaml"))


def test_paths_written_by_an_earlier_stage_may_be_missing(tmp_path, data):
    p = two_stages(tmp_path, data, lora_extra=f"tokenizer: {tmp_path}/out/pretrain/model")
    pre, lora = load_stages(p)  # runs/.../pretrain/model does not exist yet: fine, stage 0 writes it
    assert not Path(lora.config.model).exists()
    # ... but only when an *earlier* stage writes it
    swapped = yaml.safe_load(p.read_text())
    swapped["stages"].reverse()
    p2 = tmp_path / "swapped.yaml"
    p2.write_text(yaml.safe_dump(swapped))
    with pytest.raises(ConfigError) as e:
        load_stages(p2)
    assert "stages[0].model" in e.value.keys and "(stage 'lora')" in str(e.value)
    # every other missing path is still an error, named with its stage
    p.write_text(p.read_text().replace(f"model: {tmp_path}/out/pretrain/model", f"model: {tmp_path}/nowhere"))
    with pytest.raises(ConfigError) as e:
        load_stages(p)
    assert e.value.keys == ["stages[1].model"]
    assert load_stages(p, check_paths=False)[1].config.model == f"{tmp_path}/nowhere"


def test_a_produced_path_must_be_the_right_kind(tmp_path, data):
    p = two_stages(tmp_path, data)
    p.write_text(p.read_text().replace(f"model: {tmp_path}/out/pretrain/model", f"model: {tmp_path}/out/pretrain"))
    with pytest.raises(ConfigError, match=r"stages\[1\]\.model: .* is the output_dir of stage 'pretrain', which "
                                          r"writes its model to .*out/pretrain/model"):
        load_stages(p)
    text = two_stages(tmp_path, data).read_text()
    text += (f"  - name: third\n    model: {tmp_path}/out/lora/adapter\n    lora: true\n"
             f"    datasets: [{{path: {data[1]}}}]\n    output_dir: {tmp_path}/out/third\n    model_config: null\n")
    p.write_text(text)
    with pytest.raises(ConfigError, match=r"stages\[2\]\.model: stage 'lora' writes a LoRA adapter to .*adapter, "
                                          r"which belongs under `adapter_path:`"):
        load_stages(p)


def test_eval_generation_path_is_checked(tmp_path, data):
    p = two_stages(tmp_path, data, lora_extra=f"eval_generation: {{path: {tmp_path}/missing.jsonl}}")
    with pytest.raises(ConfigError) as e:
        load_stages(p)
    assert e.value.keys == ["stages[1].eval_generation.path"]


def test_finished_output_dirs_fail_up_front_unless_overwritten(tmp_path, data):
    p = two_stages(tmp_path, data)
    (tmp_path / "out" / "lora" / "adapter").mkdir(parents=True)
    with pytest.raises(ConfigError, match=r"stages\[1\]\.output_dir: .* already holds a trained adapter"):
        load_stages(p)
    p = two_stages(tmp_path, data, top_extra="overwrite_output_dir: true")
    pre, lora = load_stages(p)
    assert pre.overwrite_output_dir and lora.overwrite_output_dir


def test_clear_output_dir_removes_only_what_training_writes(tmp_path):
    out = tmp_path / "run"
    for d in ("model", "checkpoints/3", "mine"):
        (out / d).mkdir(parents=True)
    for f in ("metrics.jsonl", "loss.png", "notes.txt", "model/config.json"):
        (out / f).write_text("x")
    removed = clear_output_dir(out)
    assert sorted(p.name for p in removed) == ["checkpoints", "loss.png", "metrics.jsonl", "model"]
    assert sorted(p.name for p in out.iterdir()) == ["mine", "notes.txt"]
    assert clear_output_dir(tmp_path / "absent") == []


def test_the_quickstart_config_is_valid():
    stages = load_stages(QUICKSTART)
    assert [s.name for s in stages] == ["pretrain", "lora"]
    pre, lora = (s.config for s in stages)
    assert pre.from_scratch and pre.model_config_overrides["model_type"] == "qwen3"
    assert lora.lora and lora.model == str(Path(pre.output_dir) / "model")
    assert lora.eval_generation is not None and Path(lora.eval_generation.path).is_file()


# ---- a smoke run ------------------------------------------------------------------------------------------------

def test_two_stages_run_in_order_with_generation_eval(tmp_path, data):
    _, qa = data
    p = two_stages(tmp_path, data, lora_extra=f"eval_generation: {{path: {qa}, samples: 6, max_new_tokens: 3, "
                                              f"show: 2}}")
    results = run_stages(load_stages(p))
    assert [r.name for r in results] == ["pretrain", "lora"]
    assert (tmp_path / "out" / "pretrain" / "model" / "config.json").is_file()
    assert (tmp_path / "out" / "lora" / "adapter" / "adapter_config.json").is_file()
    saved = json.loads((tmp_path / "out" / "lora" / "generation_eval.json").read_text())
    assert saved == results[1].generation_eval
    assert saved["before"]["total"] == saved["after"]["total"] == 6 and len(saved["after"]["samples"]) == 2
    assert results[0].generation_eval is None and results[1].metrics["loss"] > 0
