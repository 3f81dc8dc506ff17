"""`surojax quantize`: an HF folder -> a GGUF file with llama.cpp's layout (the file's bytes are checked against
llama.cpp in tests/weights/test_gguf_checkpoint.py); argument errors are clean."""
import hashlib
import json
from pathlib import Path

import pytest

gguf = pytest.importorskip("gguf")

from surojax.cli.main import main  # noqa: E402

from tests.weights.gguf_tiny import tiny_model_dir  # noqa: E402

MANIFEST = json.loads((Path(__file__).parents[1] / "fixtures" / "gguf" / "models.json").read_text())


def test_quantize_writes_the_llama_cpp_file(tmp_path, capsys):
    model = tiny_model_dir("qwen3", tmp_path / "m")
    out = tmp_path / "m.gguf"
    assert main(["quantize", "--model", str(model), "--output", str(out), "--type", "q4_k_m",
                 "--name", "m"]) == 0
    assert "wrote" in capsys.readouterr().out
    r = gguf.GGUFReader(out)
    assert r.fields["general.file_type"].contents() == int(gguf.LlamaFileType.MOSTLY_Q4_K_M)
    types = {t.name: t.tensor_type.name for t in r.tensors}
    assert types["blk.0.attn_q.weight"] == "Q4_K" and types["blk.1.attn_v.weight"] == "Q6_K"
    assert types["output.weight"] == "Q6_K" and types["blk.0.attn_norm.weight"] == "F32"
    named = tmp_path / "qwen3"  # the golden file's general.name is the folder name: same bytes
    model.rename(named)
    out2 = tmp_path / "golden.gguf"
    assert main(["quantize", str(named), "--output", str(out2), "--type", "q4_k_m"]) == 0
    assert hashlib.sha256(out2.read_bytes()).hexdigest() == MANIFEST["models"]["qwen3-q4_k_m"]["sha256"]


def test_quantize_argument_errors(tmp_path, capsys):
    model = tiny_model_dir("llama", tmp_path / "m")
    assert main(["quantize", "--model", str(tmp_path / "nope"), "--output", "x.gguf", "--type", "q8_0"]) == 1
    assert "does not exist" in capsys.readouterr().err
    assert main(["quantize", "--model", str(model), "--output", str(tmp_path / "x.bin"), "--type", "q8_0"]) == 1
    assert "expected a .gguf" in capsys.readouterr().err
    (tmp_path / "e.gguf").write_bytes(b"")
    assert main(["quantize", "--model", str(model), "--output", str(tmp_path / "e.gguf"), "--type", "q8_0"]) == 1
    assert "--overwrite" in capsys.readouterr().err
    assert main(["quantize", "--model", str(model), "--output", str(tmp_path / "n.gguf"), "--type", "nf4"]) == 2


def test_quantize_a_bf16_checkpoint(tmp_path):
    """What `surojax merge` writes by default (bf16) quantises from its exact values (loaded as bf16, lossless)."""
    import jax.numpy as jnp
    import numpy as np

    from surojax.weights.gguf_checkpoint import load_gguf_model
    from surojax.weights.hf_checkpoint import load_model, save_model

    src = tiny_model_dir("llama", tmp_path / "m")
    bf16 = save_model(load_model(src, dtype=jnp.float32), tmp_path / "bf16", dtype=jnp.bfloat16, tokenizer_dir=src)
    assert main(["quantize", "--model", str(bf16), "--output", str(tmp_path / "b.gguf"), "--type", "bf16"]) == 0
    _, model, _ = load_gguf_model(tmp_path / "b.gguf", dtype=jnp.float32)
    ref = load_model(bf16, dtype=jnp.float32)
    ids = jnp.asarray([[507, 72, 101, 108]])
    np.testing.assert_array_equal(np.asarray(model(ids)), np.asarray(ref(ids)))


def test_quantize_any_model_reference(tmp_path):
    """A .gguf re-quantises to the same tensors as its HF source (F32 GGUF is lossless), and a LoRA run folder
    quantises its base with the adapter folded in (the same logits as the unmerged LoRA model)."""
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    from surojax.peft.lora import apply_lora, lora_modules
    from surojax.peft.peft_io import save_peft_adapter
    from surojax.weights.gguf_checkpoint import load_gguf_model
    from surojax.weights.hf_checkpoint import load_model

    src = tiny_model_dir("qwen3", tmp_path / "m")
    assert main(["quantize", str(src), "--output", str(tmp_path / "f32.gguf"), "--type", "f32"]) == 0
    assert main(["quantize", str(src), "--output", str(tmp_path / "a.gguf"), "--type", "q8_0"]) == 0
    assert main(["quantize", str(tmp_path / "f32.gguf"), "--output", str(tmp_path / "b.gguf"), "--type", "q8_0"]) == 0
    a, b = gguf.GGUFReader(tmp_path / "a.gguf"), gguf.GGUFReader(tmp_path / "b.gguf")
    assert [t.name for t in a.tensors] == [t.name for t in b.tensors]
    for ta, tb in zip(a.tensors, b.tensors):
        assert ta.tensor_type == tb.tensor_type and np.array_equal(ta.data, tb.data), ta.name

    lora = apply_lora(load_model(src), targets=("q_proj", "down_proj"), rank=4, alpha=8.0, rngs=nnx.Rngs(1))
    for i, (_, mod) in enumerate(sorted(lora_modules(lora).items())):
        shape = mod.lora_b.get_value().shape
        mod.lora_b.set_value(jnp.asarray(0.1 * np.random.default_rng(i).standard_normal(shape), jnp.float32))
    save_peft_adapter(lora, tmp_path / "run" / "adapter", str(src))
    assert main(["quantize", str(tmp_path / "run"), "--output", str(tmp_path / "l.gguf"), "--type", "f32"]) == 0
    _, merged, _ = load_gguf_model(tmp_path / "l.gguf", dtype=jnp.float32)
    ids = jnp.asarray([[507, 72, 101, 108]])
    np.testing.assert_allclose(np.asarray(merged(ids)), np.asarray(lora(ids)), atol=1e-4)
