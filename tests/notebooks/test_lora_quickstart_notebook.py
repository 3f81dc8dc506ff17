"""notebooks/lora_quickstart.ipynb runs top to bottom through a real Jupyter kernel (few steps)."""
import os
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")

ROOT = Path(__file__).resolve().parents[2]


def test_notebook_executes(tmp_path, monkeypatch):
    monkeypatch.setenv("SUROJAX_ROOT", str(ROOT))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    monkeypatch.setenv("SUROJAX_NOTEBOOK_RUNS", str(tmp_path / "runs"))
    monkeypatch.setenv("SUROJAX_NOTEBOOK_STEPS", "2")
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    monkeypatch.setenv("MPLBACKEND", "Agg")
    nb = nbformat.read(ROOT / "notebooks" / "lora_quickstart.ipynb", as_version=4)
    nbclient.NotebookClient(nb, timeout=300, kernel_name="python3",
                            resources={"metadata": {"path": str(ROOT / "notebooks")}}).execute()
    outputs = "".join(o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", []))
    assert "after 2 steps" in outputs
    assert "adapter_config.json" in outputs and "adapter_model.safetensors" in outputs
    assert list((tmp_path / "runs").glob("*/lora-adapter/adapter_config.json"))
