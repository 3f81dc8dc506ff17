"""Surogate's command-line forms: `serve --kv-capacity N|auto` and `grpo-colocate --train --infer --orch` (the three
GRPO files of docs/guides/rl-colocate.md, merged into `surojax grpo`'s config)."""
import json
from pathlib import Path

import pytest
import yaml

from surojax.cli.main import main
from surojax.config.grpo_colocate import merge_colocate
from surojax.config.load import read_config_file

ROOT = Path(__file__).resolve().parents[2]
QWEN3 = ROOT / "tests" / "fixtures" / "models" / "qwen3"
DOCS = ROOT / "tests" / "fixtures" / "surogate" / "grpo_colocate"


@pytest.fixture
def served(monkeypatch):
    import surojax.serve.launch as launch

    seen = []
    monkeypatch.setattr(launch, "serve", lambda config: seen.append(config) or 0)
    return seen


def test_kv_capacity_sizes_the_kv_cache_in_tokens(served, capsys):
    assert main(["serve", str(QWEN3), "--kv-capacity", "1000", "--block-size", "16"]) == 0
    assert served[-1].engine.num_blocks == 63  # ceil(1000 / 16): at least 1000 tokens
    assert main(["serve", str(QWEN3), "--kv-capacity", "auto"]) == 0
    assert served[-1].engine.num_blocks is None  # from free device memory, as when neither flag is given
    assert main(["serve", str(QWEN3), "--kv-capacity", "64", "--num-kv-blocks", "4"]) == 1
    assert "give one" in capsys.readouterr().err
    assert main(["serve", str(QWEN3), "--kv-capacity", "lots"]) == 2


def test_the_documented_three_files_merge_or_are_refused_with_the_one_yaml_command(tmp_path, capsys):
    parsed = {role: read_config_file(DOCS / f"{role}.yaml") for role in ("train", "infer", "orch")}
    merged = merge_colocate(*(p[0] for p in parsed.values()), {r: p[1] for r, p in parsed.items()})
    data = merged.data
    assert (data["trainer"], data["num_generations"], data["max_completion_length"], data["temperature"],
            data["top_p"], data["gradient_accumulation_steps"], data["max_steps"]) == ("grpo", 4, 1024, 1.0, 1.0,
                                                                                       4, 20)
    refused = {(role, p.key) for role, ps in merged.problems.items() for p in ps}
    assert refused == {("infer", "port"), ("orch", "model.lora_adapter"), ("orch", "env"), ("orch", "output_dir")}
    assert main(["grpo-colocate", *(f"--{r}={DOCS / r}.yaml" for r in ("train", "infer", "orch"))]) == 1
    err = capsys.readouterr().err
    assert "orch.yaml:9:1: env: is not read: environments are not available" in err
    assert "surojax grpo CONFIG" in err


def test_disagreeing_files_are_errors_at_their_lines():
    merged = merge_colocate({"model": "a", "sequence_len": 64, "lora": True, "lora_rank": 8},
                            {"model": "b", "max_model_len": 128, "max_lora_rank": 4},
                            {"model": {"name": "a", "lora_rank": 16}, "max_steps": 3, "sampling": {"top_k": 5}},
                            {"infer": {("model",): (2, 1)}})
    keys = {(role, p.key, p.line) for role, ps in merged.problems.items() for p in ps}
    assert keys == {("infer", "model", 2), ("infer", "max_model_len", None), ("infer", "max_lora_rank", None),
                    ("orch", "model.lora_rank", None), ("orch", "sampling.top_k", None)}


def test_grpo_colocate_trains_as_surojax_grpo(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    with open("prompts.jsonl", "w") as f:
        for i in range(8):
            f.write(json.dumps({"prompt": f"Say {i}:", "answer": str(i)}) + "\n")
    train = {"model": str(QWEN3), "output_dir": "out", "gpus": 1, "per_device_train_batch_size": 4,
             "learning_rate": 1e-3, "lr_scheduler_type": "constant", "recipe": "fp32", "recompute": "none",
             "lora": True, "lora_rank": 4, "lora_alpha": 8, "datasets": [{"path": "prompts.jsonl", "type": "prompt"}],
             "reward_functions": ["exact_match"], "seed": 0}
    infer = {"backend": "surogate", "model": str(QWEN3), "enable_lora": True, "max_model_len": 48, "max_num_seqs": 4}
    orch = {"model": {"name": str(QWEN3), "lora_rank": 4}, "batch_size": 4, "rollouts_per_example": 4,
            "sequence_len": 48, "max_steps": 1, "use_token_client": True, "sampling": {"max_tokens": 8}}
    for name, data in (("train", train), ("infer", infer), ("orch", orch)):
        Path(f"{name}.yaml").write_text(yaml.safe_dump(data))
    assert main(["grpo-colocate", "--train", "train.yaml", "--infer", "infer.yaml", "--orch", "orch.yaml"]) == 0
    one_yaml = yaml.safe_load(Path("out/grpo_colocate.yaml").read_text())
    assert (one_yaml["num_generations"], one_yaml["gradient_accumulation_steps"], one_yaml["max_completion_length"],
            one_yaml["trainer"]) == (4, 1, 8, "grpo")
    assert "surojax grpo out/grpo_colocate.yaml" in capsys.readouterr().err
    rows = [json.loads(line) for line in Path("out/metrics.jsonl").read_text().splitlines()]
    assert rows[0]["step"] == 1 and "reward" in rows[0]
    assert Path("out/adapter_config.json").is_file() and Path("out/adapter/adapter_config.json").is_file()
