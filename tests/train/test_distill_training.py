"""Distillation through the Trainer (trainer: distill): a random tiny qwen3 student learns from the qwen3 fixture
teacher; --precompute's sidecar gives the online run's first step; distillation keys and teachers are checked; the
online teacher is counted in the memory plan and placed on the run's mesh like the student (the 8-device run is a
check of the one 8-device child tests/parallel/virtual_devices.py shares: no process start-up of its own)."""
import json
import re
import shlex
import shutil
import struct
import tempfile
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import yaml
from flax import nnx
from scipy.special import logsumexp

from surojax.cli.main import main
from surojax.config import ConfigError, config_from_dict, load_config
from surojax.offload.memory_plan import MemoryPlanError
from surojax.train import distill as distill_module
from surojax.train.run_spec import TrainSetupError
from surojax.train.trainers import make_trainer
from surojax.weights.hf_checkpoint import load_model
from tests.parallel.virtual_devices import check_passed, shared_child_results
from tests.train.conftest import FIXTURE_QWEN3 as TEACHER, distill_config, tiny_run_config, write_hybrid_model

TEACHER_ARCH = {"model_type": "qwen3", "vocab_size": 512, "hidden_size": 64, "intermediate_size": 128,
                "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16}
# The one-device student of the online runs: the teacher's architecture, 4 rows in one micro-batch. One shape for
# the tests below (training, sidecar, sharded twin): their training step compiles once (the in-process jit cache /
# the persistent cache) instead of once per test.
ONE_DEVICE = dict(model_config=dict(TEACHER_ARCH), per_device_train_batch_size=4, gradient_accumulation_steps=1)


@pytest.fixture(scope="module")
def one_device_run(tmp_path_factory) -> tuple[Path, list[dict]]:
    """The one-device online run of ONE_DEVICE, 10 steps: (its output folder, its per-step metrics rows). Built once:
    the loss-and-KL test reads its curve, the 8-device test its step 1 (the reference of the sharded step)."""
    tmp = tmp_path_factory.mktemp("distill_one_device")
    cfg = config_from_dict(distill_config(lambda **kw: tiny_run_config(tmp, **kw), max_steps=10, report_to=["jsonl"],
                                          **ONE_DEVICE))
    make_trainer(cfg).train()
    rows = [json.loads(x) for x in (Path(cfg.output_dir) / "metrics.jsonl").read_text().splitlines()]
    return Path(cfg.output_dir), [r for r in rows if "kl" in r]


def test_distillation_lowers_loss_and_kl(one_device_run):
    out, steps = one_device_run
    assert len(steps) == 10 and all({"loss", "kl", "ce"} <= set(r) for r in steps)
    first, last = steps[0], steps[-1]
    # loss = alpha T^2 kl + (1 - alpha) ce with the logged per-token means
    np.testing.assert_allclose(first["loss"], 0.5 * 4.0 * first["kl"] + 0.5 * first["ce"], rtol=1e-5)
    assert last["loss"] < 0.8 * first["loss"], (first, last)
    assert last["kl"] < 0.8 * first["kl"], (first, last)
    assert (out / "model" / "model.safetensors").is_file()


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


def test_precomputed_sidecar_gives_the_online_first_step(tiny_config, tmp_path, capsys):
    """... and the command --precompute prints trains from it as printed: the user's own overrides kept, quoted."""
    d = distill_config(tiny_config, max_steps=1, report_to=[], validation_split_ratio=0.1, **ONE_DEVICE)
    d.pop("trainer")  # implied by `surojax distill`
    config_file = tmp_path / "distill.yaml"
    config_file.write_text(yaml.safe_dump({**d, "max_steps": 7}))
    own = ["max_steps=1", "wandb_project=my project"]  # the run as the user asked for it: these overrides included
    assert main(["distill", str(config_file), "--precompute", "--logprobs-dtype", "float32", "-o", own[0], "-o",
                 own[1]]) == 0
    sidecar = Path(d["output_dir"]) / "teacher_logprobs"
    printed = capsys.readouterr().out.splitlines()[-1].removeprefix("train from it with: ")
    argv = shlex.split(printed)
    assert argv[argv.index("distill"):] == ["distill", str(config_file), "-o", own[0], "-o", own[1], "-o",
                                            f"teacher_logprobs={sidecar}"]
    meta = json.loads((sidecar / "meta.json").read_text())
    assert meta["top_k"] == 16 and meta["dtype"] == "float32" and meta["positions"] > 0

    online = make_trainer(config_from_dict({**d, "trainer": "distill"}))
    first_online = online.step()
    eval_batch = next(iter(online.data.eval))
    eval_online = online.teacher.topk(eval_batch)
    online.close()
    from_file = make_trainer(load_config(config_file, [*argv[argv.index("distill") + 2:][1::2], "trainer=distill"]))
    assert from_file.cfg.teacher_logprobs == str(sidecar) and from_file.plan.total_steps == 1
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


def _safetensors_bytes_fp32(path: Path) -> int:
    """4 bytes per value of every tensor a safetensors file holds (read from its JSON header)."""
    with open(path, "rb") as f:
        header = json.loads(f.read(struct.unpack("<Q", f.read(8))[0]))
    return 4 * sum(int(np.prod(t["shape"])) for name, t in header.items() if name != "__metadata__")


def test_online_teacher_is_counted_and_a_run_it_overflows_is_refused(tiny_config, monkeypatch):
    cfg = config_from_dict(distill_config(tiny_config, report_to=[], **ONE_DEVICE))
    trainer = make_trainer(cfg)  # CPU: no capacity known, nothing refused
    teacher, plan = trainer.teacher.memory, trainer.memory_plan
    summary = "\n".join(trainer.summary_lines())
    trainer.close()
    # fp32 recipe, one device: the teacher's resident bytes are its checkpoint's values at 4 bytes each
    assert teacher.resident == _safetensors_bytes_fp32(TEACHER / "model.safetensors")
    assert 0 < teacher.transient < plan.activations + plan.logits + plan.workspace
    assert trainer.peak_memory == plan.total + teacher.resident  # its forward runs between steps, in their room
    assert f"weights {teacher.resident / 2**30:.2f} GiB" in summary  # the start-up summary states its size
    monkeypatch.setattr(distill_module, "device_capacity", lambda: plan.total + teacher.resident // 2)
    refusal = rf"training .* plus teacher {re.escape(str(TEACHER))} 0\.\d+ GiB \(weights"  # names it, with its size
    with pytest.raises(MemoryPlanError, match=refusal):
        make_trainer(cfg)


CHILD_CHECKS: dict = {}


def _sharded_spec(x) -> str:
    """P(None, None) and P() both replicate: the spec without trailing Nones."""
    s = list(x.sharding.spec)
    while s and s[-1] is None:
        s.pop()
    return str(s)


def check_teacher_sharded_like_the_student() -> dict:
    """In the 8-device child: step 1 of the one-device test's run on data 2 x fsdp 2 x tensor 2, 1 row per device
    (the global batch of 4 rows the reference takes on one device) -> its kl, loss, device count and the specs of the
    teacher's and the student's arrays."""
    def specs(state):
        return {".".join(map(str, p)): _sharded_spec(v.get_value()) for p, v in nnx.to_flat_state(state)}

    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        cfg = distill_config(lambda **kw: tiny_run_config(tmp, **kw), **{**ONE_DEVICE, "max_steps": 1,
                                                                         "report_to": [],
                                                                         "per_device_train_batch_size": 1},
                             parallel={"data": 2, "fsdp": 2, "tensor": 2}, output_dir=str(tmp / "eight"))
        t = make_trainer(config_from_dict(cfg))
        try:
            m = t.step()
            return {"kl": float(m["kl"]), "loss": float(m["loss"]), "devices": jax.device_count(),
                    "teacher": specs(t.teacher.state), "student": specs(t.trainable)}
        finally:
            t.close()


CHILD_CHECKS["check_teacher_sharded_like_the_student"] = check_teacher_sharded_like_the_student


def test_teacher_sharded_like_the_student_gives_the_one_device_step(one_device_run, tmp_path_factory):
    """A student of the teacher's architecture on data 2 x fsdp 2 x tensor 2 (8 virtual CPU devices): every teacher
    weight has its student twin's sharding, and step 1's kl / loss equal one device's (the one-device run's step 1:
    its loss is taken before any update, so the run's length does not change it; fp32; sums over shards are taken
    in another order, hence 1e-5)."""
    m1 = one_device_run[1][0]
    results = shared_child_results(tmp_path_factory, __file__, devices=8)
    name = "check_teacher_sharded_like_the_student"
    check_passed(results, name, "8 devices")
    eight = results[f"{name}.value"]
    assert eight["devices"] == 8
    student, teacher = eight["student"], eight["teacher"]
    assert {k: teacher.get(k) for k in student} == student
    assert any("fsdp" in s for s in student.values()) and any("tensor" in s for s in student.values())
    np.testing.assert_allclose([eight["kl"], eight["loss"]], [m1["kl"], m1["loss"]], rtol=1e-5)


@pytest.mark.parametrize("family", ["qwen3_5_text", "gemma3_text"])
def test_hybrid_student_and_teacher_kl_equals_their_logits(tiny_config, tmp_path, family):
    """A student of a fixture's architecture (LoRA: it starts as its base) and another teacher of it (other
    weights), K = V: step 1's kl and ce equal KL(softmax(z_t / T) || softmax(z_s / T)) and the CE computed here from
    the two models' own logits on the step's packed batch (the teacher's forward and the student's: Qwen3.5's
    DeltaNet layers with their segment resets; Gemma 3's sliding-window layers of window 4 over packed segments,
    its scaled embeddings and sandwich norms)."""
    student, teacher = (write_hybrid_model(tmp_path / name, seed, family) for name, seed in (("student", 0),
                                                                                             ("teacher", 1)))
    cfg = config_from_dict(distill_config(tiny_config, from_scratch=False, model_config=None, model=str(student),
                                          teacher=str(teacher), lora=True, lora_rank=4, teacher_top_k=512,
                                          max_steps=1, gradient_accumulation_steps=1, report_to=[]))
    trainer = make_trainer(cfg)
    seen = []
    next_batch = trainer.next_batch
    trainer.next_batch = lambda: seen.append(next_batch()) or seen[-1]
    m = trainer.step()
    trainer.close()
    batch = seen[0]
    inputs = [jnp.asarray(batch[k]) for k in ("tokens", "positions", "segment_ids")]
    (graphdef, s_state), (_, t_state) = (nnx.split(load_model(path, dtype=jnp.float32, attention="xla"))
                                         for path in (student, teacher))
    logits = jax.jit(lambda state: nnx.merge(graphdef, state)(*inputs))  # one program for both models
    z_s, z_t = (np.asarray(logits(state), np.float64) for state in (s_state, t_state))
    T, mask = 2.0, batch["loss_mask"] > 0
    log_p, log_q = (z / T - logsumexp(z / T, axis=-1, keepdims=True) for z in (z_t, z_s))
    kl = np.sum(np.exp(log_p) * (log_p - log_q), axis=-1)[mask].mean()
    ce = (logsumexp(z_s, axis=-1) - np.take_along_axis(z_s, batch["targets"][..., None], -1)[..., 0])[mask].mean()
    assert kl > 1e-3  # two different models (random, so close to uniform at T = 2)
    np.testing.assert_allclose([m["kl"], m["ce"]], [kl, ce], rtol=1e-5)
