"""Golden fixture for image conversation rows: a tiny Qwen3-VL processor directory and what transformers'
`Qwen3VLProcessor` (AutoProcessor) makes of a few conversations with images.

Run with the reference environment (transformers 5.17, Pillow, no torchvision: the PIL image processor):

    /work/refenv/bin/python scripts/make_vision_chat_fixtures.py

tests/fixtures/vision_chat/
    tokenizer.json, tokenizer_config.json   the fixture tokenizer (tests/fixtures/tokenizer) plus Qwen's vision
                                            tokens <|vision_start|> 512, <|vision_end|> 513, <|image_pad|> 514,
                                            <|video_pad|> 515, and a Qwen3-VL style ChatML template (image /
                                            image_url / video / text parts, as Qwen3-VL's chat_template.json)
    preprocessor_config.json                Qwen2VLImageProcessor, patch 16, merge 2, mean = std = 0.5, small bounds
    processor_config.json                   processor_class Qwen3VLProcessor
    img_a.png (70x100 RGB), img_b.png (50x30 RGBA)   generated images
    expected.json                           per case: the messages given to the processor, input_ids,
                                            image_grid_thw, and pixel_values' shape; expected.npz the pixel_values
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import tokenizers
from PIL import Image

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "tests" / "fixtures" / "vision_chat"
VISION_TOKENS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]

# Qwen3-VL-Instruct's template, cut to what the fixture needs (no tools, no reasoning): string or part contents.
TEMPLATE = (
    "{%- set image_count = namespace(value=0) -%}{%- set video_count = namespace(value=0) -%}"
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message.role + '\\n' -}}"
    "{%- if message.content is string -%}{{ message.content }}"
    "{%- else -%}{%- for content in message.content -%}"
    "{%- if content.type == 'image' or 'image' in content or 'image_url' in content -%}"
    "{%- set image_count.value = image_count.value + 1 -%}"
    "{%- if add_vision_id %}Picture {{ image_count.value }}: {% endif -%}"
    "<|vision_start|><|image_pad|><|vision_end|>"
    "{%- elif content.type == 'video' or 'video' in content -%}"
    "{%- set video_count.value = video_count.value + 1 -%}"
    "<|vision_start|><|video_pad|><|vision_end|>"
    "{%- elif 'text' in content -%}{{ content.text }}{%- endif -%}"
    "{%- endfor -%}{%- endif -%}{{- '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)
PREPROCESSOR = {"image_processor_type": "Qwen2VLImageProcessor", "patch_size": 16, "temporal_patch_size": 2,
                "merge_size": 2, "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5],
                "size": {"shortest_edge": 32 * 32, "longest_edge": 64 * 96}}


def _image(seed: int, width: int, height: int, mode: str) -> Image.Image:
    rng = np.random.default_rng(seed)
    pixels = rng.integers(0, 256, (height, width, 4 if mode == "RGBA" else 3), dtype=np.uint8)
    return Image.fromarray(pixels, mode)


def write_processor_dir() -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    src = ROOT / "tests" / "fixtures" / "tokenizer"
    tok = tokenizers.Tokenizer.from_file(str(src / "tokenizer.json"))
    tok.add_special_tokens([tokenizers.AddedToken(t, special=True, normalized=False) for t in VISION_TOKENS])
    tok.save(str(OUT / "tokenizer.json"))
    config = json.loads((src / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    for t in VISION_TOKENS:
        config["added_tokens_decoder"][str(tok.token_to_id(t))] = {
            "content": t, "lstrip": False, "normalized": False, "rstrip": False, "single_word": False,
            "special": True}
    config["additional_special_tokens"] = config["additional_special_tokens"] + VISION_TOKENS
    config["chat_template"] = TEMPLATE
    (OUT / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    (OUT / "preprocessor_config.json").write_text(json.dumps(PREPROCESSOR, indent=2) + "\n")
    (OUT / "processor_config.json").write_text(json.dumps({"processor_class": "Qwen3VLProcessor"}, indent=2) + "\n")
    _image(1, 70, 100, "RGB").save(OUT / "img_a.png")
    _image(2, 50, 30, "RGBA").save(OUT / "img_b.png")


def cases() -> dict[str, list[dict]]:
    """Conversations as transformers' processors take them (image parts; the images given separately)."""
    return {
        "two_images": [
            {"role": "system", "content": "You compare pictures."},
            {"role": "user", "content": [{"type": "text", "text": "First "}, {"type": "image"},
                                         {"type": "text", "text": " then "}, {"type": "image"},
                                         {"type": "text", "text": " differ?"}]},
            {"role": "assistant", "content": [{"type": "text", "text": "Yes, they differ."}]},
            {"role": "user", "content": "Why?"},
            {"role": "assistant", "content": "Colours."}],
        # the `<image>` placeholder row {"messages": [user "<image>What is it?<image>", ...], "images": [b, a]}
        # in the content-part form it means: each placeholder replaced by the next image, in place.
        "placeholder": [
            {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is it?"},
                                         {"type": "image"}]},
            {"role": "assistant", "content": "Noise."}],
    }


IMAGES = {"two_images": ["img_a.png", "img_b.png"], "placeholder": ["img_b.png", "img_a.png"]}


def main() -> None:
    write_processor_dir()
    from transformers import AutoTokenizer
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
    from transformers.models.qwen3_vl.processing_qwen3_vl import Qwen3VLProcessor
    # AutoProcessor.from_pretrained(OUT) without torchvision refuses (its video processor and the default image
    # processor need it); torchvision is absent on purpose: the PIL image processor is the one surojax equals.
    class ImagesOnlyQwen3VLProcessor(Qwen3VLProcessor):  # no video processor: these rows hold no video
        def check_argument_for_proper_class(self, name, argument):
            return None if name == "video_processor" and argument is None else \
                super().check_argument_for_proper_class(name, argument)

    processor = ImagesOnlyQwen3VLProcessor(image_processor=Qwen2VLImageProcessorPil.from_pretrained(str(OUT)),
                                 tokenizer=AutoTokenizer.from_pretrained(str(OUT)), video_processor=None,
                                 chat_template=TEMPLATE)
    print(type(processor).__name__, type(processor.image_processor).__name__)
    expected, arrays = {}, {}
    for name, messages in cases().items():
        text = processor.apply_chat_template(messages, tokenize=False)
        images = [Image.open(OUT / f) for f in IMAGES[name]]
        out = processor(text=[text], images=images, return_tensors="np")
        expected[name] = {"messages": messages, "images": IMAGES[name], "text": text,
                          "input_ids": np.asarray(out["input_ids"][0]).tolist(),
                          "image_grid_thw": np.asarray(out["image_grid_thw"]).tolist(),
                          "pixel_values_shape": list(np.asarray(out["pixel_values"]).shape)}
        arrays[f"{name}_pixel_values"] = np.asarray(out["pixel_values"], np.float32)
        print(name, expected[name]["image_grid_thw"], len(expected[name]["input_ids"]))
    (OUT / "expected.json").write_text(json.dumps(expected, indent=1) + "\n")
    np.savez_compressed(OUT / "expected.npz", **arrays)


if __name__ == "__main__":
    main()
