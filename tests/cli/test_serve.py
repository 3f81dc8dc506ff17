"""`surojax serve` / scripts/serve.py: argument errors are one clean line (the server itself: tests/serve)."""
import subprocess
import sys
from pathlib import Path

from surojax.cli.main import main

ROOT = Path(__file__).resolve().parents[2]


def test_missing_model_and_gguf_are_clean_errors(tmp_path, capsys):
    assert main(["serve", str(tmp_path / "nope")]) == 1
    assert "does not exist" in capsys.readouterr().err
    (tmp_path / "g").mkdir()
    gguf = tmp_path / "g" / "m.gguf"
    gguf.write_bytes(b"GGUF")  # the magic and nothing else: a named error, not a traceback
    assert main(["serve", str(gguf)]) == 1
    assert str(gguf) in capsys.readouterr().err
    assert main(["serve", str(tmp_path)]) == 1
    assert "not a model folder" in capsys.readouterr().err


def test_script_is_the_same_entry_point():
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "serve.py"), "--help"], capture_output=True, text=True,
                       env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"}, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    assert "--enable-lora" in r.stdout and "--api-key" in r.stdout


def test_serve_log_has_no_backend_probe_line(monkeypatch, caplog):
    """jax's INFO "Unable to initialize backend 'tpu'" is dropped once `surojax serve` runs; its other records stay."""
    import logging

    import surojax.serve.launch as launch

    monkeypatch.setattr(launch, "serve", lambda config: 0)
    assert main(["serve", str(ROOT / "tests" / "fixtures" / "models" / "qwen3")]) == 0
    probe = logging.getLogger("jax._src.xla_bridge")
    with caplog.at_level(logging.INFO, logger=probe.name):  # other tests may have raised jax._src's level
        probe.info("Unable to initialize backend 'tpu': INTERNAL: Failed to open libtpu.so")
        probe.info("another record")
    assert [r.getMessage() for r in caplog.records if r.name == probe.name] == ["another record"]


def test_missing_serving_package_is_one_line_with_the_install_command(monkeypatch, capsys):
    """An environment without fastapi (None in sys.modules: not found, and its import fails): one error line that
    names it and the pip command for this interpreter, before any model loads; no traceback."""
    monkeypatch.setitem(sys.modules, "fastapi", None)
    assert main(["serve", str(ROOT / "tests" / "fixtures" / "models" / "qwen3")]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    assert "surojax serve needs fastapi" in err and f"{sys.executable} -m pip install fastapi uvicorn" in err, err
