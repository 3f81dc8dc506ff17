"""The README's "Fine-tune on images" flow on the tiny Qwen3-VL (tests/train/test_vlm_training.py's folder with the
vision_chat tokenizer): configs/examples/lora_qwen3_vl_images.yaml with its model, output folder and sizes
overridden trains 2 steps on the shipped examples/data/images rows; the run's output folder then serves an image
of the held-out rows (a data URL through the openai client, `surojax serve OUTPUT_DIR`) with the adapter folded
in: the greedy answer equals `surojax generate --model OUTPUT_DIR --chat --image PNG`, which differs from the
base model's (the adapter is applied). The image processor travels with the adapter (preprocessor_config.json)."""
from __future__ import annotations

import base64
import contextlib
import io
import json

import openai

from surojax.cli.main import main
from surojax.config import load_config
from surojax.data.tokenizer import Tokenizer
from surojax.train.trainer import Trainer
from tests.serve.configs import BUCKETS
from tests.serve.live_server import live_server
from tests.train.test_vlm_training import ROOT, _tiny_vlm_folder

IMAGE = ROOT / "examples" / "data" / "images" / "img" / "red_circle_128x96.png"  # only test.jsonl asks about it
QUESTION = "What shape and colour is this?"


def cli_generate(model) -> list[int]:
    """`surojax generate --model MODEL --chat --image IMAGE --prompt QUESTION` (greedy, 6 tokens) -> new ids."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["generate", "--model", str(model), "--chat", "--image", str(IMAGE), "--prompt", QUESTION,
                     "--max-new-tokens", "6", "--ignore-eos", "--show-ids"]) == 0
    return json.loads(out.getvalue().strip().splitlines()[-1])["new_ids"]


def test_example_config_trains_on_the_image_dataset_and_the_run_serves_an_image(tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)  # the example's dataset paths are relative to the repository root, as in the README
    base, out = _tiny_vlm_folder(tmp_path), tmp_path / "out"
    cfg = load_config(ROOT / "configs" / "examples" / "lora_qwen3_vl_images.yaml", overrides=[
        f"model={base}", f"output_dir={out}", "max_steps=2", "max_pixels=1024", "sequence_len=128",
        "recipe=fp32", "recompute=none", "learning_rate=0.05", "per_device_train_batch_size=2"])
    trainer = Trainer(cfg)
    assert trainer.data.stats.images > 0
    trainer.train()
    assert (out / "adapter" / "preprocessor_config.json").is_file()

    tuned = cli_generate(out)
    assert tuned != cli_generate(base)
    url = "data:image/png;base64," + base64.b64encode(IMAGE.read_bytes()).decode()
    argv = ["--served-model-name", "shapes", "--max-num-seqs", "2", "--block-size", "4", "--num-kv-blocks", "64",
            "--max-model-len", "96", "--max-num-batched-tokens", "64"]
    with live_server(argv, buckets=BUCKETS, model=out) as (server, _):
        client = openai.OpenAI(base_url=server + "/v1", api_key="x", max_retries=0)
        got = client.chat.completions.create(
            model="shapes", max_tokens=6, temperature=0, extra_body={"ignore_eos": True},
            messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                                   {"type": "text", "text": QUESTION}]}])
    assert got.choices[0].message.content == Tokenizer.from_dir(base).decode(tuned, skip_special_tokens=True)
