"""notebooks/lora_quickstart.ipynb runs top to bottom through a real Jupyter kernel (few steps), with the kernel's own
matplotlib backend (inline): the loss plot shows, and training shows one progress output, not a line per step."""
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
    monkeypatch.delenv("MPLBACKEND", raising=False)  # the kernel's inline backend, as in a user's notebook
    nb = nbformat.read(ROOT / "notebooks" / "lora_quickstart.ipynb", as_version=4)
    nbclient.NotebookClient(nb, timeout=300, kernel_name="python3",
                            resources={"metadata": {"path": str(ROOT / "notebooks")}}).execute()
    outputs = "".join(o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", []))
    assert "after 2 steps" in outputs
    assert "adapter_config.json" in outputs and "adapter_model.safetensors" in outputs
    assert list((tmp_path / "runs").glob("*/lora-adapter/adapter_config.json"))

    def cell(text: str):
        return next(c for c in nb.cells if c.cell_type == "code" and text in c.source)

    # pretraining (4 steps): the summary, the first step's time, one progress output updated in place, "done"
    shown = [o.get("text") or o.get("data", {}).get("text/plain", "") for o in cell("pretrain.train()").outputs]
    assert len(shown) <= 5 and not any(line.startswith("step ") for text in shown for line in text.splitlines())
    assert any("train" in text and "4/4" in text for text in shown), shown
    # writing loss.png in pretrain.train() left the inline backend alone: the LoRA loss plot is in the notebook
    assert any("image/png" in o.get("data", {}) for o in cell("plt.show()").outputs)
