"""GGUF split files (`name-00001-of-0000N.gguf`): a model split by gguf-py's own writer (GGUFWriter with
`split_max_tensors`, the file copied by gguf-py's gguf_new_metadata) reads, from any part's name, as the unsplit
file: the same metadata, tensors and logits; a missing or mismatched part is an error naming the file expected;
LoRA trains over it through the Trainer, and `surojax quantize` takes it as input."""
from __future__ import annotations

import hashlib
import shutil

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

gguf = pytest.importorskip("gguf")

from gguf.scripts.gguf_new_metadata import copy_with_new_metadata  # noqa: E402

from surojax.cli.main import main  # noqa: E402
from surojax.config import config_from_dict  # noqa: E402
from surojax.peft.lora import LORA_TARGETS, base_linear  # noqa: E402
from surojax.quant import Q8_0  # noqa: E402
from surojax.train.trainer import Trainer  # noqa: E402
from surojax.weights.gguf_checkpoint import load_gguf_model, save_gguf  # noqa: E402
from surojax.weights.gguf_reader import GGUFError, read_gguf  # noqa: E402
from surojax.weights.gguf_split import SPLIT_COUNT, SPLIT_NO, SPLIT_TENSORS, read_gguf_model  # noqa: E402
from surojax.weights.model_ref import ModelRefError, resolve_model  # noqa: E402
from tests.train.conftest import write_instruction_data  # noqa: E402
from tests.weights.gguf_tiny import PROMPT_IDS, tiny_model_dir  # noqa: E402

SPLIT_KEYS = {SPLIT_NO, SPLIT_COUNT, SPLIT_TENSORS}


def split_with_gguf_py(src, out_dir, max_tensors: int, small_first_shard: bool = False) -> list:
    """`src` rewritten by gguf-py as a split model in out_dir (same stem): its parts, in order."""
    reader = gguf.GGUFReader(str(src))
    arch = str(bytes(reader.fields["general.architecture"].parts[-1]), "utf-8")
    out_dir.mkdir(parents=True, exist_ok=True)
    writer = gguf.GGUFWriter(str(out_dir / src.name), arch, split_max_tensors=max_tensors,
                             small_first_shard=small_first_shard)
    copy_with_new_metadata(reader, writer, {}, [])
    return sorted(out_dir.glob(f"{src.stem}-*-of-*.gguf"))


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("gguf_split")
    hf = tiny_model_dir("qwen3", root / "hf")
    whole = save_gguf(hf, root / "tiny.gguf", "q8_0")
    return whole, split_with_gguf_py(whole, root / "split", max_tensors=8)


def _tensors(gf) -> dict:
    return {t.name: (t.tensor_type, t.shape, hashlib.sha256(np.asarray(t.data).tobytes()).hexdigest())
            for t in gf.tensors}


@nnx.jit
def _logits(model, tokens):
    return model(tokens)


def test_parts_read_as_the_unsplit_file(files, tmp_path):
    whole, parts = files
    ref = read_gguf(whole)
    assert len(parts) == 4 and parts[0].name == "tiny-00001-of-00004.gguf"
    by_part = [read_gguf(p) for p in parts]
    assert "general.architecture" in by_part[0].fields and set(by_part[1].fields) == SPLIT_KEYS  # gguf-py's layout
    assert sum(len(p.tensors) for p in by_part) == len(ref.tensors)
    for name in (parts[0], parts[2]):  # the first part's name or another's
        got = read_gguf_model(name)
        assert {k: v for k, v in got.fields.items() if k not in SPLIT_KEYS} == ref.fields
        assert _tensors(got) == _tensors(ref)
    metadata_first = split_with_gguf_py(whole, tmp_path / "meta", max_tensors=8, small_first_shard=True)
    assert read_gguf(metadata_first[0]).tensors == [] and _tensors(read_gguf_model(metadata_first[-1])) == \
        _tensors(ref)

    _, split_model, tokenizer = load_gguf_model(parts[1])
    _, whole_model, whole_tokenizer = load_gguf_model(whole)
    assert isinstance(base_linear(split_model, "q_proj").kernel.get_value(), Q8_0)
    assert tokenizer.encode("What is 3 plus 4?") == whole_tokenizer.encode("What is 3 plus 4?")
    tokens = jnp.asarray([PROMPT_IDS])
    np.testing.assert_array_equal(np.asarray(_logits(split_model, tokens)), np.asarray(_logits(whole_model, tokens)))
    ref_model = resolve_model(str(parts[3]))
    assert (ref_model.kind, ref_model.name) == ("gguf", "tiny")


def test_a_missing_or_mismatched_part_is_named(files, tmp_path):
    _, parts = files
    d = tmp_path / "broken"
    shutil.copytree(parts[0].parent, d)
    (d / parts[1].name).unlink()
    with pytest.raises(GGUFError, match=r"part 2 of 4 of this split model is missing: expected .*/broken/"
                                        r"tiny-00002-of-00004\.gguf"):
        read_gguf_model(d / parts[0].name)
    shutil.copy(d / parts[2].name, d / parts[1].name)  # part 3 under part 2's name
    with pytest.raises(GGUFError, match=r"tiny-00002-of-00004\.gguf: expected part 2 of 4 \(split\.no 1, "
                                        r"split\.count 4\) .* found split\.no 2, split\.count 4"):
        read_gguf_model(d / parts[3].name)
    shutil.copy(d / parts[0].name, d / "renamed.gguf")
    with pytest.raises(GGUFError, match=r"renamed\.gguf: part 1 of a model split in 4 files .* does not end in "
                                        r"-00001-of-00004\.gguf"):
        read_gguf_model(d / "renamed.gguf")
    shutil.copy(d / parts[0].name, d / "tiny-00001-of-00005.gguf")
    with pytest.raises(GGUFError, match=r"its name says part 1 of 5, its metadata .* says part 1 of 4"):
        read_gguf_model(d / "tiny-00001-of-00005.gguf")
    with pytest.raises(ModelRefError, match=r"broken holds GGUF files \(renamed\.gguf, tiny-00001-of-00004\.gguf, "
                                            r".*\) and no config\.json: name the \.gguf file"):
        resolve_model(str(d))


def test_lora_trains_over_a_split_gguf(files, tmp_path):
    _, parts = files
    cfg = config_from_dict(dict(
        model=str(parts[0]), output_dir=str(tmp_path / "out"), recipe="fp32", recompute="none", lora=True,
        lora_rank=4, lora_alpha=8, datasets=[{"path": str(write_instruction_data(tmp_path / "inst.jsonl")),
                                                "type": "instruction"}],
        sequence_len=32, per_device_train_batch_size=2, gradient_accumulation_steps=1, learning_rate=1e-2,
        lr_scheduler_type="constant", max_steps=2))
    trainer = Trainer(cfg)
    trainer.train()
    losses = [r["loss"] for r in trainer.metrics.history if "loss" in r]
    assert len(losses) == 2 and all(np.isfinite(losses))
    assert all(isinstance(base_linear(trainer.trained_model(), n).kernel.get_value(), Q8_0) for n in LORA_TARGETS)
    assert (tmp_path / "out" / "adapter" / "adapter_model.safetensors").is_file()


def test_quantize_reads_a_split_model(files, tmp_path):
    """`surojax quantize` from a split q8_0 model writes the bytes it writes from the unsplit one."""
    whole, parts = files
    assert main(["quantize", str(whole), "--output", str(tmp_path / "a.gguf"), "--type", "q8_0"]) == 0
    assert main(["quantize", str(parts[2]), "--output", str(tmp_path / "b.gguf"), "--type", "q8_0"]) == 0
    assert (tmp_path / "a.gguf").read_bytes() == (tmp_path / "b.gguf").read_bytes()
