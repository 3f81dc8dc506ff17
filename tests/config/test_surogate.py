"""Surogate's configs as documented (surojax/config/surogate.py): its documented example config validates and trains,
every key of its reference is read or refused (never an unknown key), each alias maps, each refusal names why or
the equivalent, an alias that disagrees with its surojax key is an error at the user's line, and a Surogate-looking
config's start-up summary lists the defaults that differ from Surogate's."""
import json
import logging
import random
from pathlib import Path

import pytest
import yaml
from rich.console import Console

from surojax.config import ConfigError, config_from_dict, load_config
from surojax.config.surogate import REFUSED
from surojax.config.surogate_defaults import differing_defaults, summary_lines

ROOT = Path(__file__).resolve().parents[2]
FIXTURES = ROOT / "tests" / "fixtures"
EXAMPLE = FIXTURES / "surogate" / "example_config.yaml"
REFERENCE = yaml.safe_load((FIXTURES / "surogate" / "reference_keys.yaml").read_text())
QWEN3 = FIXTURES / "models" / "qwen3"
BASE = {"model": "m", "datasets": [{"path": "d.jsonl"}]}


def _problems(data: dict) -> list:
    try:
        config_from_dict(data)
    except ConfigError as e:
        return e.problems
    return []


def write_finetome(path: Path, n: int = 80) -> Path:
    """Rows shaped like mlabonne/FineTome-100k: sharegpt `conversations` (from / value), plus its other columns."""
    rng = random.Random(0)
    with open(path, "w") as f:
        for _ in range(n):
            a, b = rng.randint(0, 9), rng.randint(0, 9)
            turns = [{"from": "human", "value": f"What is {a} plus {b}?"}, {"from": "gpt", "value": f"It is {a + b}."}]
            f.write(json.dumps({"conversations": turns, "source": "arith", "score": 5.0}) + "\n")
    return path


# ---- the documented example ------------------------------------------------------------------------------------

def test_the_documented_example_validates_as_written(caplog, monkeypatch):
    import surojax.config.load as load

    monkeypatch.setattr(load, "_TABS_WARNED", set())  # warned once per file and line per process: not yet here
    with caplog.at_level(logging.WARNING):
        cfg = load_config(EXAMPLE)
    # its three tab-indented lines (a Markdown habit YAML refuses) are read at the Markdown tab stop, with a warning
    tabs = [r.getMessage() for r in caplog.records if "indented with a tab" in r.getMessage()]
    assert len(tabs) == 3 and all(m.startswith(f"{EXAMPLE}:") for m in tabs), tabs
    ds = cfg.datasets[0]
    assert (ds.path, ds.type, ds.messages_field, ds.split) == ("mlabonne/FineTome-100k", "conversation",
                                                               "conversations", "train")
    assert (cfg.model_type, cfg.template, cfg.truncation_strategy, cfg.use_chat_template) == ("qwen", "qwen",
                                                                                              "delete", True)
    assert (cfg.seed, cfg.dataloader_num_workers, cfg.use_cuda_graphs, cfg.parallel.data) == (1234, 4, True, 1)
    assert (cfg.recipe, cfg.recompute, cfg.lora, cfg.lora_dropout, cfg.lora_dtype) == ("bf16", "full", True, 0.05,
                                                                                       "fp32")
    assert (cfg.num_epochs, cfg.save_steps, cfg.save_total_limit, cfg.warmup_ratio) == (3, 100, 3, 0.03)
    assert {"train_seed", "gpus", "torch_dtype", "eval_seed", "padding_side"} <= set(cfg._surogate_spellings)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """The documented example trained for 2 steps on CPU: model and data pointed at tiny fixtures, shorter rows."""
    from surojax.train.trainer import Trainer

    tmp = tmp_path_factory.mktemp("surogate_example")
    data = write_finetome(tmp / "finetome.jsonl")
    cfg = load_config(EXAMPLE, [f"model={QWEN3}", f"datasets.0.path={data}", f"output_dir={tmp / 'output'}",
                                "sequence_len=128", "max_steps=2"])
    console = Console(record=True, width=240)
    trainer = Trainer(cfg, console=console)
    trainer.train()
    return cfg, console.export_text(), tmp / "output"


def test_the_documented_example_trains_and_lists_the_differing_defaults(trained):
    cfg, text, out = trained
    assert "step 2/2" in text and "done" in text
    lines = [line for line in text.splitlines() if line.startswith("surogate")]
    listed = {line.split()[1] for line in lines if "(Surogate:" in line}
    # the example leaves these unset, and surojax's defaults differ from Surogate's documented ones
    assert {"optimizer", "weight_decay", "resume_from_checkpoint", "checkpoint_dir", "zero_stage"} <= listed
    assert not listed & {"lr_scheduler_type", "lora_dropout", "validation_split_ratio", "num_epochs", "sequence_len"}
    assert any("adamw  (Surogate: adamw_8bit)" in line for line in lines)
    assert any(line.startswith("surogate  eval_seed") for line in lines)


def test_the_final_adapter_is_also_at_the_top_of_output_dir(trained):
    from surojax.weights.model_ref import resolve_model

    _, _, out = trained
    for name in ("adapter_config.json", "adapter_model.safetensors"):
        assert (out / name).read_bytes() == (out / "adapter" / name).read_bytes()
    assert resolve_model(out).adapter == out / "adapter"  # a run's folder first: it has the tokenizer files
    top_only = out.parent / "top_only"
    top_only.mkdir()
    for name in ("adapter_config.json", "adapter_model.safetensors"):
        (top_only / name).write_bytes((out / name).read_bytes())
    ref = resolve_model(top_only)  # Surogate's layout: the adapter's files at the top of output_dir
    assert ref.adapter == top_only and ref.weights == QWEN3.resolve()


def test_merge_takes_the_output_dir_either_way(trained, tmp_path):
    from surojax.cli.main import main

    _, _, out = trained
    top_only = tmp_path / "output"
    top_only.mkdir()
    for name in ("adapter_config.json", "adapter_model.safetensors"):
        (top_only / name).write_bytes((out / name).read_bytes())
    for label, folder in (("run", out), ("top", top_only)):
        assert main(["merge", "--base-model", str(QWEN3), "--checkpoint-dir", str(folder), "--output",
                     str(tmp_path / label), "--dtype", "fp32"]) == 0
    merged = [(tmp_path / label / "model.safetensors").read_bytes() for label in ("run", "top")]
    assert merged[0] == merged[1] and merged[0] != (QWEN3 / "model.safetensors").read_bytes()


# ---- every documented key ---------------------------------------------------------------------------------------

def _cases():
    for key, value in REFERENCE["top"].items():
        yield key, {**BASE, key: value}, key
    for block, keys in REFERENCE["blocks"].items():
        for key, value in keys.items():
            base = {"teacher_model": "T"} if block == "distillation" else {"type": "dpo"} if block == "loss" else {}
            yield f"{block}.{key}", {**BASE, block: {**base, key: value}}, block
    for key, value in REFERENCE["dataset"].items():
        yield f"datasets[0].{key}", {**BASE, "datasets": [{"path": "d.jsonl", key: value}]}, "datasets[0]"


@pytest.mark.parametrize("name,data,where", list(_cases()), ids=[c[0] for c in _cases()])
def test_every_documented_key_is_read_or_refused_naming_why(name, data, where):
    problems = _problems(data)
    assert not [p for p in problems if "unknown key" in p.message], problems
    # a refusal is about the key written (or the block it is in), with a reason
    assert all(p.key.startswith(where) or p.key.startswith(name) for p in problems), problems


# ---- aliases ----------------------------------------------------------------------------------------------------

ALIASES = [
    ({"zero_level": 2}, {"zero_stage": 2}),
    ({"zero_level": 1, "shard_gradients": True}, {"zero_stage": 2}),
    ({"shard_weights": True}, {"zero_stage": 3}),
    ({"adamw_beta1": 0.8, "adamw_beta2": 0.95, "adamw_epsilon": 1e-6},
     {"adam_beta1": 0.8, "adam_beta2": 0.95, "adam_epsilon": 1e-6}),
    ({"train_seed": 7}, {"seed": 7}),
    ({"gpus": 8, "ep_size": 2}, {"parallel.data": 4, "parallel.expert": 2}),
    ({"gpus": 0}, {"parallel.data": -1}),
    ({"recipe": "fp8-hybrid"}, {"recipe": "fp8_hybrid"}),
    ({"lora": True, "lora_target_modules": ["all"]},
     {"lora_target_modules": ["all-linear"]}),  # Surogate's "all": every Linear target of the model
    ({"torch_dtype": "float32"}, {"recipe": "fp32"}),
    ({"torch_dtype": "bfloat16"}, {"recipe": "bf16"}),
    ({"master_dtype": "bfloat16", "gradient_dtype": "bfloat16"}, {"master_dtype": "bf16", "gradient_dtype": "bf16"}),
    ({"recipe": "fp32", "gradient_dtype": "float32"}, {"gradient_dtype": "fp32"}),
    ({"cpu_training": True, "lora": True}, {"offload_base_weights": True, "offload_prefetch": True}),
    ({"cpu_training": True}, {"offload_master": True, "offload_optimizer": True}),
    # Surogate's CPU optimizer is whole on every rank: its zero_level 1 (the documented default) shards nothing there
    ({"cpu_training": True, "zero_level": 1}, {"zero_stage": 0, "offload_optimizer": True}),
    ({"rope_scaling": '{"factor": 2.0, "type": "yarn"}'}, {"rope_scaling": {"factor": 2.0, "type": "yarn"}}),
    ({"rope_scaling": "yarn", "max_model_len": 4096}, {"rope_scaling": "yarn"}),
    ({"run_name": "r", "wandb_name": "w", "report_to": "wandb"}, {"run_name": "r", "wandb_name": "w"}),
    ({"report_to": ["aim"], "aim_experiment": "e", "aim_repo": "/tmp/aim"},
     {"report_to": ["aim"], "aim_experiment": "e"}),
    ({"distillation": {"teacher_model": "T", "top_k": 32, "temperature": 2.0, "kd_weight": 0.7, "ce_weight": 0.3}},
     {"trainer": "distill", "teacher": "T", "teacher_top_k": 32, "temperature": 2.0, "alpha": 0.7}),
    ({"loss": {"type": "dpo", "dpo_beta": 0.2, "reference_free": True}},
     {"trainer": "dpo", "beta": 0.2, "reference_free": True}),
    ({"system": "Be brief.", "datasets": [{"path": "a"}, {"path": "b", "system_prompt": "own"}]},
     {"datasets.0.system_prompt": "Be brief.", "datasets.1.system_prompt": "own"}),
    ({"datasets": [{"path": "a", "system_prompt_type": "field", "system_prompt_field": "sys"}]},
     {"datasets.0.system_field": "sys"}),
    ({"master_dtype": None, "validation_datasets": None, "router_z_loss_coef": None},
     {"master_dtype": "fp32", "validation_datasets": [], "router_z_loss_coef": 0.0}),
    ({"noise_scheduler": {"enabled": False, "sigma_start": 0.05}, "doc_masking": True, "use_zero_copy": False},
     {"trainer": "sft"}),
]


def _get(cfg, path: str):
    node = cfg
    for part in path.split("."):
        node = node[int(part)] if part.isdigit() else getattr(node, part)
    return node


@pytest.mark.parametrize("surogate,expected", ALIASES, ids=[",".join(a) for a, _ in ALIASES])
def test_each_alias_maps(surogate, expected):
    cfg = config_from_dict({**BASE, **surogate})
    assert {k: _get(cfg, k) for k in expected} == expected
    assert cfg._surogate_spellings  # the config now looks like Surogate's


def test_surogate_zeros_ask_for_nothing():
    # Surogate's documented 0 defaults, written out: warmup_steps 0 lets warmup_ratio apply (as in Surogate's
    # trainers), cooldown_steps 0 and skip_quant_* 0 are accepted with any schedule / recipe
    cfg = config_from_dict({**BASE, "warmup_steps": 0, "warmup_ratio": 0.1, "cooldown_steps": 0,
                            "skip_quant_first_layers": 0, "lr_scheduler_type": "cosine"})
    assert cfg.warmup_steps_for(100) == 10
    assert _problems({**BASE, "warmup_steps": 5, "warmup_ratio": 0.1})  # both set: still one too many


def test_an_alias_given_with_its_surojax_key_must_agree(tmp_path):
    path = tmp_path / "train.yaml"
    path.write_text("model: m\ndatasets: [{path: d.jsonl}]\nzero_stage: 1\nzero_level: 2\nadam_beta1: 0.9\n"
                    "adamw_beta1: 0.9\n")
    with pytest.raises(ConfigError) as e:
        load_config(path)
    (p,) = e.value.problems
    assert (p.key, p.line) == ("zero_level", 4) and "zero_stage: 1" in p.message
    assert load_config(path, ["zero_stage=2"]).zero_stage == 2  # equal values: fine


def test_a_bad_value_is_reported_at_the_users_key_and_line(tmp_path):
    path = tmp_path / "train.yaml"
    path.write_text("model: m\ndatasets: [{path: d.jsonl}]\nadamw_beta2: 1.5\n")
    with pytest.raises(ConfigError) as e:
        load_config(path)
    (p,) = e.value.problems
    assert (p.key, p.line) == ("adamw_beta2", 3) and "read as adam_beta2" in p.message


# ---- refusals ---------------------------------------------------------------------------------------------------

NAMED = {  # refused key and value -> what the message names (the surojax equivalent, or why not)
    "offload_residual": (True, "recompute: offload"),
    "parallelism": ("dispatch_pp", "parallel: {stage: N}"),
    "distributed": ({"num_nodes": 2}, "surojax launch"),
    "sequence_parallel_size": (2, "parallel: {data"),
    "loss_scale": ("all", "train_on_inputs"),
    "normuon_momentum": (0.9, "optimizer: adamw"),
    "single_sample_bins": (True, "sample_packing: false"),
    "use_all_to_all_reduce": (True, "XLA"),
    "agent_template": ("react", "tools_field"),
}


@pytest.mark.parametrize("key", sorted(REFUSED))
def test_each_refused_key_names_why_and_accepts_what_asks_for_nothing(key):
    rule = REFUSED[key]
    value, named = NAMED.get(key, ("surely-not-a-no-op", ""))
    (p,) = _problems({**BASE, key: value})
    assert p.key == key and p.message.startswith("is not read by surojax: ") and named in p.message
    for off in rule.off:
        assert _problems({**BASE, key: off}) == []


@pytest.mark.parametrize("surogate,key,named", [
    ({"torch_dtype": "float16"}, "torch_dtype", "bfloat16"),
    ({"padding_side": "left"}, "padding_side", "right"),
    ({"rope_scaling": "dynamic"}, "rope_scaling", "yarn"),
    ({"template": "seed_oss"}, "template", "chat_template"),
    ({"distillation": {"teacher_model": "T", "kd_dir": "d"}}, "distillation.kd_dir", "teacher_logprobs"),
    ({"distillation": {"teacher_model": "T", "kd_weight": 0.7, "ce_weight": 1.0}}, "distillation.ce_weight",
     "1 - alpha"),
    ({"loss": {"type": "dpo", "kl_tau": 0.1}}, "loss.kl_tau", "beta"),
    ({"gpus": 8, "ep_size": 3}, "gpus", "expert"),
    ({"cpu_training": True, "zero_level": 2}, "cpu_training", "zero_level: 2"),
    ({"recipe": "nvfp4_quartet"}, "recipe", "recipe: nvfp4"),
    ({"datasets": [{"path": "a", "prompt_format": "{system}: {instruction}"}]}, "datasets[0].prompt_format",
     "system_prompt"),
    ({"datasets": [{"path": "a", "system_prompt_type": "fixed"}]}, "datasets[0].system_prompt_type", "system_prompt"),
])
def test_rule_refusals_name_the_equivalent(surogate, key, named):
    problems = _problems({**BASE, **surogate})
    assert [p.key for p in problems] == [key] and named in problems[0].message, problems


# ---- the start-up summary ----------------------------------------------------------------------------------------

def test_a_surojax_config_prints_no_surogate_lines():
    cfg = config_from_dict({**BASE, "lora": True, "seed": 1, "zero_stage": 0})
    assert summary_lines(cfg) == [] and cfg._surogate_spellings == ()
    dumped = config_from_dict(config_from_dict({**BASE, "lora": True}).model_dump())  # every key written out
    assert summary_lines(dumped) == []


def test_differing_defaults_are_those_left_unset_that_apply():
    cfg = config_from_dict({**BASE, "lora": True, "train_seed": 3, "optimizer": "adamw_8bit", "max_steps": 10})
    listed = {k for k, _, _ in differing_defaults(cfg)}
    assert "optimizer" not in listed and "seed" not in listed  # set (seed through train_seed)
    assert "num_epochs" not in listed  # max_steps set: epochs do not apply
    assert {"lr_scheduler_type", "weight_decay", "lora_dropout", "validation_split_ratio"} <= listed
    full = config_from_dict({**BASE, "zero_level": 0})
    listed = {k for k, _, _ in differing_defaults(full)}
    assert "lora" in listed and "lora_dropout" not in listed and "master_dtype" in listed
    assert any("lora" in line and "(Surogate: true (LoRA))" in line for line in summary_lines(full))


def test_yaml_indented_with_tabs_is_read_at_the_markdown_tab_stop(tmp_path):
    from surojax.config.load import parse_yaml

    data, _ = parse_yaml("datasets:\n  - path: a\n\ttype: text\nnote: |\n  keep\ttab\n", str(tmp_path / "x.yaml"))
    assert data == {"datasets": [{"path": "a", "type": "text"}], "note": "keep\ttab\n"}
    with pytest.raises(ConfigError, match="YAML syntax error"):
        parse_yaml("a: [1\nb: 2\n")
