"""Run keys surojax reads for Surogate's configs: model_type (checked against config.json), rope_scaling as a type
name with max_model_len (Surogate's factor rule), use_cuda_graphs (XLA's command buffers), report_to: aim."""
import json
import math
import sys
import types
from pathlib import Path

import pytest

from surojax.config import config_from_dict
from surojax.train.run_spec import TrainSetupError, model_config_for
from surojax.train import xla_options
from surojax.train.metrics import Metrics

QWEN3 = Path(__file__).resolve().parents[2] / "tests" / "fixtures" / "models" / "qwen3"  # max_position_embeddings 256


def _cfg(**kw):
    return config_from_dict({"model": str(QWEN3), "datasets": [{"path": "d.jsonl"}], "sequence_len": 256, **kw})


@pytest.mark.parametrize("name", ["qwen3", "qwen", "QWEN3"])
def test_model_type_names_the_model_or_its_family(name):
    assert model_config_for(_cfg(model_type=name)).model_type == "qwen3"


@pytest.mark.parametrize("name", ["llama", "qwen3_moe", "qwen2_5"])
def test_a_model_type_the_model_is_not_is_refused(name):
    with pytest.raises(TrainSetupError, match=f"model_type: '{name}' does not match .* model_type 'qwen3'"):
        model_config_for(_cfg(model_type=name))


def test_rope_scaling_type_takes_its_factor_from_max_model_len():
    cfg = model_config_for(_cfg(rope_scaling="yarn", max_model_len=1000))
    rs = cfg.rope_scaling
    assert (rs.rope_type, rs.factor, rs.original_max_position_embeddings) == ("yarn", math.ceil(1000 / 256), 256)
    assert cfg.max_position_embeddings == 1000 and cfg.rope_theta == 10000.0
    lin = model_config_for(_cfg(rope_scaling="linear", max_model_len=512)).rope_scaling
    assert (lin.rope_type, lin.factor) == ("linear", 2.0)
    same = model_config_for(_cfg(rope_scaling='{"type": "yarn", "factor": 4.0}', max_model_len=1024)).rope_scaling
    assert (same.rope_type, same.factor, same.original_max_position_embeddings) == ("yarn", 4.0, 256)
    with pytest.raises(TrainSetupError, match="set max_model_len"):
        model_config_for(_cfg(rope_scaling="yarn"))


def test_a_rope_scaling_dict_keeps_the_models_rope_theta(tmp_path):
    # transformers 5 writes rope_theta inside rope_parameters, which a rope_scaling of the config replaces
    hf = json.loads((QWEN3 / "config.json").read_text())
    hf["rope_parameters"]["rope_theta"] = 1e6
    (tmp_path / "config.json").write_text(json.dumps(hf))
    for rope in ({"rope_type": "linear", "factor": 2.0}, "linear"):
        cfg = model_config_for(_cfg(model=str(tmp_path), rope_scaling=rope, max_model_len=512))
        assert (cfg.rope_theta, cfg.rope_scaling.factor) == (1e6, 2.0)


def test_use_cuda_graphs_false_sets_xlas_command_buffer_flag(monkeypatch):
    assert xla_options.command_buffers_off("--a=1 --xla_gpu_enable_command_buffer=")
    assert not xla_options.command_buffers_off("--xla_gpu_enable_command_buffer= "
                                               "--xla_gpu_enable_command_buffer=FUSION")  # the last one wins
    monkeypatch.setenv("XLA_FLAGS", "--xla_backend_optimization_level=0")
    monkeypatch.setattr(xla_options, "_backend_started", lambda: False)
    xla_options.apply_xla_options([_cfg(use_cuda_graphs=True), _cfg()])  # XLA's default: nothing to set
    assert xla_options.os.environ["XLA_FLAGS"] == "--xla_backend_optimization_level=0"
    xla_options.apply_xla_options([_cfg(use_cuda_graphs=False)])
    assert xla_options.os.environ["XLA_FLAGS"].split() == ["--xla_backend_optimization_level=0",
                                                          "--xla_gpu_enable_command_buffer="]
    with pytest.raises(xla_options.XlaOptionsError, match="turns CUDA graphs off"):
        xla_options.apply_xla_options([_cfg(use_cuda_graphs=True)])
    with pytest.raises(xla_options.XlaOptionsError, match="disagree"):
        xla_options.apply_xla_options([_cfg(use_cuda_graphs=True), _cfg(use_cuda_graphs=False)])


def test_use_cuda_graphs_after_the_backend_started(monkeypatch):
    monkeypatch.setenv("XLA_FLAGS", "")
    monkeypatch.setattr(xla_options, "_backend_started", lambda: True)
    monkeypatch.setattr(xla_options.jax, "default_backend", lambda: "gpu")
    with pytest.raises(xla_options.XlaOptionsError, match="before JAX starts its GPU backend"):
        xla_options.apply_xla_options([_cfg(use_cuda_graphs=False)])
    monkeypatch.setattr(xla_options.jax, "default_backend", lambda: "cpu")
    xla_options.apply_xla_options([_cfg(use_cuda_graphs=False)])  # no CUDA graphs on CPU


def test_report_to_aim_tracks_every_metric(tmp_path, monkeypatch):
    runs = []

    class Run:  # the part of aim's Run the sink uses
        def __init__(self, repo=None, experiment=None):
            self.repo, self.experiment, self.name, self.items = repo, experiment, None, {}
            self.tracked, self.closed = [], False
            runs.append(self)

        def __setitem__(self, key, value):
            self.items[key] = value

        def track(self, value, name, step):
            self.tracked.append((name, step, value))

        def close(self):
            self.closed = True

    monkeypatch.setitem(sys.modules, "aim", types.SimpleNamespace(Run=Run))
    cfg = _cfg(report_to=["aim"], run_name="r1", aim_experiment="exp", aim_repo=str(tmp_path / "aim"))
    m = Metrics(tmp_path, cfg.report_to, run_config={"lr": 1.0}, run_name=cfg.run_name,
                aim_experiment=cfg.aim_experiment, aim_repo=cfg.aim_repo, aim_name=cfg.aim_name)
    m.write(1, {"loss": 2.5})
    m.close()
    (run,) = runs
    assert (run.repo, run.experiment, run.name, run.items, run.closed) == (str(tmp_path / "aim"), "exp", "r1",
                                                                          {"hparams": {"lr": 1.0}}, True)
    assert run.tracked == [("loss", 1, 2.5)]
    assert (tmp_path / "metrics.jsonl").read_text().count("loss") == 1


def test_gpus_that_do_not_fit_the_devices_say_how_gpus_is_read():
    import jax

    from surojax.parallel import MeshError
    from surojax.train.trainer import run_mesh

    n = jax.device_count() + 1
    with pytest.raises(MeshError, match=r"gpus: N is read as parallel.data.*CUDA_VISIBLE_DEVICES.*gpus: 0"):
        run_mesh(_cfg(gpus=n))
    with pytest.raises(MeshError) as e:  # surojax's own spelling: the mesh error alone
        run_mesh(_cfg(parallel={"data": n}))
    assert "gpus" not in str(e.value)
    assert run_mesh(_cfg(gpus=0)).size == jax.device_count()


def test_rope_scaling_type_over_a_model_already_scaled_starts_from_its_original_context(tmp_path):
    # Surogate: with no original_max_position_embeddings, the original context is max_position_embeddings / factor
    hf = json.loads((QWEN3 / "config.json").read_text())
    hf["rope_parameters"] = {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}  # 256 = 2 x 128
    (tmp_path / "config.json").write_text(json.dumps(hf))
    cfg = model_config_for(_cfg(model=str(tmp_path), rope_scaling="yarn", max_model_len=1024))
    assert (cfg.rope_scaling.factor, cfg.rope_scaling.original_max_position_embeddings) == (8.0, 128)
