"""Distillation through the Trainer (trainer: distill): a random tiny qwen3 student learns from the qwen3 fixture
teacher; --precompute's sidecar gives the online run's first step; distillation keys and teachers are checked."""
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import yaml

from surojax.cli.main import main
from surojax.config import ConfigError, config_from_dict
from surojax.train.run_spec import TrainSetupError
from surojax.train.trainers import make_trainer

from tests.train.conftest import FIXTURE_QWEN3 as TEACHER, distill_config


def test_distillation_lowers_loss_and_kl(tiny_config):
    cfg = config_from_dict(distill_config(tiny_config, max_steps=10, report_to=["jsonl"]))
    trainer = make_trainer(cfg)
    trainer.train()
    rows = [json.loads(x) for x in (Path(cfg.output_dir) / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "kl" in r]
    assert len(steps) == 10 and all({"loss", "kl", "ce"} <= set(r) for r in steps)
    first, last = steps[0], steps[-1]
    # loss = alpha T^2 kl + (1 - alpha) ce with the logged per-token means
    np.testing.assert_allclose(first["loss"], 0.5 * 4.0 * first["kl"] + 0.5 * first["ce"], rtol=1e-5)
    assert last["loss"] < 0.8 * first["loss"], (first, last)
    assert last["kl"] < 0.8 * first["kl"], (first, last)
    assert (Path(cfg.output_dir) / "model" / "model.safetensors").is_file()


def test_lora_student_equal_to_its_teacher_has_zero_kl(tiny_config):
    """The student is the teacher plus a LoRA adapter (B = 0 at the start) and K = V: the teacher's entries line up
    with the student's positions, so the first step's KL is 0 (and its CE the teacher's own)."""
    cfg = config_from_dict(distill_config(tiny_config, from_scratch=False, model_config=None, model=str(TEACHER),
                                          lora=True, lora_rank=4, teacher_top_k=512, max_steps=1,
                                          gradient_accumulation_steps=1, report_to=[]))
    trainer = make_trainer(cfg)
    m = trainer.step()
    trainer.close()
    assert m["kl"] < 1e-6 and m["ce"] > 1.0, m


def test_precomputed_sidecar_gives_the_online_first_step(tiny_config, tmp_path):
    d = distill_config(tiny_config, max_steps=1, report_to=[], validation_split_ratio=0.1)
    d.pop("trainer")  # implied by `surojax distill`
    config_file = tmp_path / "distill.yaml"
    config_file.write_text(yaml.safe_dump(d))
    assert main(["distill", str(config_file), "--precompute", "--logprobs-dtype", "float32"]) == 0
    sidecar = Path(d["output_dir"]) / "teacher_logprobs"
    meta = json.loads((sidecar / "meta.json").read_text())
    assert meta["top_k"] == 16 and meta["dtype"] == "float32" and meta["positions"] > 0

    online = make_trainer(config_from_dict({**d, "trainer": "distill"}))
    first_online = online.step()
    eval_batch = next(iter(online.data.eval))
    eval_online = online.teacher.topk(eval_batch)
    online.close()
    from_file = make_trainer(config_from_dict({**d, "trainer": "distill", "teacher_logprobs": str(sidecar),
                                               "output_dir": str(tmp_path / "out2")}))
    assert not hasattr(from_file.teacher, "state")  # the teacher was never loaded
    first_file = from_file.step()
    eval_file = from_file.teacher.topk(eval_batch)
    from_file.close()
    for key in ("loss", "kl", "ce", "grad_norm"):
        np.testing.assert_allclose(first_file[key], first_online[key], rtol=1e-5, err_msg=key)
    sup = eval_batch["loss_mask"] > 0  # the validation rows are in the sidecar too
    np.testing.assert_array_equal(eval_file["teacher_ids"][sup], eval_online["teacher_ids"][sup])
    np.testing.assert_allclose(eval_file["teacher_logps"][sup], eval_online["teacher_logps"][sup], rtol=1e-6)


def test_distillation_keys_and_teachers_are_checked(tiny_config, tmp_path):
    with pytest.raises(ConfigError, match="teacher_top_k"):  # a distillation key on an SFT run
        config_from_dict(tiny_config(teacher_top_k=8))
    with pytest.raises(ConfigError, match="teacher"):  # a distillation run without a teacher
        config_from_dict(tiny_config(trainer="distill"))
    config_file = tmp_path / "sft.yaml"
    config_file.write_text(yaml.safe_dump(tiny_config(trainer="sft")))
    assert main(["distill", str(config_file)]) == 1  # `surojax distill` refuses a config of another trainer
    # a teacher whose tokenizer maps two tokens the other way round is refused before any weight is loaded
    other = tmp_path / "teacher"
    shutil.copytree(TEACHER, other)
    tok = json.loads((other / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    a, b = list(vocab)[100:102]
    vocab[a], vocab[b] = vocab[b], vocab[a]
    (other / "tokenizer.json").write_text(json.dumps(tok))
    with pytest.raises(TrainSetupError, match="different tokenizer"):
        make_trainer(config_from_dict(distill_config(tiny_config, teacher=str(other))))
