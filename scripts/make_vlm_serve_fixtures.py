"""Golden fixture for serving a vision-language model: a tiny Qwen3-VL checkpoint that takes the vision_chat
processor's tokens and images, and what transformers' `generate` makes of chat prompts with an image.

Run with the reference environment (transformers 5.17, torch, Pillow; no torchvision: the PIL image processor):

    /work/refenv/bin/python scripts/make_vlm_serve_fixtures.py

tests/fixtures/models/qwen3_vl_chat/
    config.json, model.safetensors   Qwen3VLForConditionalGeneration: vocab 516 (the vision_chat tokenizer's:
                                     <|vision_start|> 512, <|vision_end|> 513, <|image_pad|> 514, <|video_pad|>
                                     515), text 2 layers (hidden 32, 4 heads over 2 kv heads of 16, M-RoPE
                                     [4, 2, 2] interleaved, untied head), tower 2 blocks (hidden 16, patch 16,
                                     temporal 2, merge 2, 16 learned positions, deepstack after blocks 0 and 1)
    tokenizer.json, tokenizer_config.json, preprocessor_config.json, processor_config.json
                                     copied from tests/fixtures/vision_chat (a processor directory)
    img_c.png                        a third noise image of img_a.png's size (70x100: the same grid, so the same
                                     prompt ids with other pixels)
    expected.json                    per case: messages (the image as a file name), the processor's input_ids and
                                     image_grid_thw, and `generate(do_sample=False, max_new_tokens=8,
                                     eos_token_id=None)`'s new ids (fp32, eager attention)

tests/fixtures/vlm/generate.json      for two decoders of scripts/make_vlm_fixtures.py, `generate`'s 8 greedy new ids
                                     on one case of tests/fixtures/vlm/NAME.npz: qwen3_vl (Qwen3-VL, vocab 256) case
                                     b (two images), qwen3_5_moe (Qwen3.5 MoE: Gated DeltaNet layers beside
                                     attention, its tower; image token ids 250..253 set on the config as that
                                     script does) case a (qwen3_5's greedy ids repeat one token: too weak a check)

The script fails unless case a and case c (same text, other image) generate different tokens, and unless every
greedy step's top-1 / top-2 logit gap is > 1e-3.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import torch
from PIL import Image

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "tests" / "fixtures" / "vision_chat"
OUT = ROOT / "tests" / "fixtures" / "models" / "qwen3_vl_chat"
NEW_TOKENS = 8
TOKENS = dict(image_token_id=514, video_token_id=515, vision_start_token_id=512, vision_end_token_id=513)
TEXT = dict(vocab_size=516, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-6, max_position_embeddings=512,
            initializer_range=0.2, tie_word_embeddings=False,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [4, 2, 2],
                             "mrope_interleaved": True})
VISION = dict(depth=2, hidden_size=16, intermediate_size=32, num_heads=2, in_channels=3, patch_size=16,
              temporal_patch_size=2, spatial_merge_size=2, out_hidden_size=32, num_position_embeddings=16,
              deepstack_visual_indexes=[0, 1], initializer_range=0.2)
FILES = ("tokenizer.json", "tokenizer_config.json", "preprocessor_config.json", "processor_config.json")


def cases() -> dict[str, dict]:
    """name -> (image file, messages as transformers' processor takes them: the image part then the text)."""
    def user(text):
        return [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": text}]}]
    return {"a": {"image": "img_a.png", "messages": user("What is in it?")},
            "c": {"image": "img_c.png", "messages": user("What is in it?")},
            "b": {"image": "img_b.png", "messages": [{"role": "system", "content": "Be brief."}]
                  + user("Describe the picture.")}}


def _perturb(model, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or ".norm" in name:
                if name.endswith(".bias"):
                    p.copy_(0.2 * torch.randn(p.shape, generator=g, dtype=torch.float64).to(p.dtype))
                else:
                    p.copy_(1 + 0.3 * torch.randn(p.shape, generator=g, dtype=torch.float64).to(p.dtype))


def processor():
    from transformers import AutoTokenizer
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
    from transformers.models.qwen3_vl.processing_qwen3_vl import Qwen3VLProcessor

    class ImagesOnlyQwen3VLProcessor(Qwen3VLProcessor):  # no video processor (needs torchvision): no video here
        def check_argument_for_proper_class(self, name, argument):
            return None if name == "video_processor" and argument is None else \
                super().check_argument_for_proper_class(name, argument)

    tok = AutoTokenizer.from_pretrained(str(OUT))
    return ImagesOnlyQwen3VLProcessor(image_processor=Qwen2VLImageProcessorPil.from_pretrained(str(OUT)),
                                      tokenizer=tok, video_processor=None, chat_template=tok.chat_template)


def main() -> None:
    from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration
    shutil.rmtree(OUT, ignore_errors=True)
    OUT.mkdir(parents=True)
    torch.manual_seed(45)
    config = Qwen3VLConfig(text_config=dict(TEXT), vision_config=dict(VISION), tie_word_embeddings=False, **TOKENS)
    config._attn_implementation = "eager"
    model = Qwen3VLForConditionalGeneration(config).float().eval()
    _perturb(model, 45)
    model.save_pretrained(OUT)
    (OUT / "generation_config.json").unlink(missing_ok=True)
    for f in FILES:
        shutil.copy(SRC / f, OUT / f)
    rng = np.random.default_rng(3)
    Image.fromarray(rng.integers(0, 256, (100, 70, 3), dtype=np.uint8), "RGB").save(OUT / "img_c.png")
    proc = processor()
    image_dir = {"img_a.png": SRC, "img_b.png": SRC, "img_c.png": OUT}
    expected = {}
    for name, case in cases().items():
        text = proc.apply_chat_template(case["messages"], tokenize=False, add_generation_prompt=True)
        image = Image.open(image_dir[case["image"]] / case["image"])
        inputs = proc(text=[text], images=[image], return_tensors="pt")
        with torch.no_grad():
            out = model.generate(**inputs, do_sample=False, max_new_tokens=NEW_TOKENS, eos_token_id=None,
                                 output_scores=True, return_dict_in_generate=True)
        prompt = inputs["input_ids"][0].tolist()
        new = out.sequences[0, len(prompt):].tolist()
        gaps = [float(torch.topk(s[0], 2).values.diff().abs()) for s in out.scores]
        assert len(new) == NEW_TOKENS and min(gaps) > 1e-3, (name, new, gaps)
        expected[name] = {"image": case["image"], "messages": case["messages"], "input_ids": prompt,
                          "image_grid_thw": inputs["image_grid_thw"].tolist(), "new_ids": new,
                          "min_top2_gap": min(gaps)}
        print(name, inputs["image_grid_thw"].tolist(), len(prompt), new, f"gap {min(gaps):.3g}")
    assert expected["a"]["input_ids"] == expected["c"]["input_ids"], "a and c must share the prompt ids"
    assert expected["a"]["new_ids"] != expected["c"]["new_ids"], "the image must change the output"
    (OUT / "expected.json").write_text(json.dumps(expected, indent=1) + "\n")
    print(json.dumps({p.name: p.stat().st_size for p in sorted(OUT.iterdir())}))


def _greedy(model, inputs) -> list[int]:
    with torch.no_grad():
        out = model.generate(**inputs, do_sample=False, max_new_tokens=NEW_TOKENS, eos_token_id=None,
                             output_scores=True, return_dict_in_generate=True)
    gaps = [float(torch.topk(s[0], 2).values.diff().abs()) for s in out.scores]
    assert min(gaps) > 1e-3, gaps
    return out.sequences[0, inputs["input_ids"].shape[1]:].tolist()


def decoders() -> None:
    """Greedy ids of a case of tests/fixtures/vlm/NAME.npz -> vlm/generate.json."""
    from transformers import AutoConfig, AutoModelForImageTextToText
    models = ROOT / "tests" / "fixtures" / "models"
    out = {}
    for name, c in (("qwen3_vl", "b"), ("qwen3_5_moe", "a")):
        config = AutoConfig.from_pretrained(models / name)
        for k, v in {"image_token_id": 250, "video_token_id": 251, "vision_start_token_id": 252,
                     "vision_end_token_id": 253}.items():
            setattr(config, k, v)
        config._attn_implementation = "eager"
        model = AutoModelForImageTextToText.from_pretrained(models / name, config=config, dtype=torch.float32,
                                                            experts_implementation="eager").eval()
        case = np.load(ROOT / "tests" / "fixtures" / "vlm" / f"{name}.npz")
        ids = torch.tensor(case[f"{c}_ids"][None])
        inputs = dict(input_ids=ids, attention_mask=torch.ones_like(ids), pixel_values=torch.tensor(case[f"{c}_pixels"]),
                      image_grid_thw=torch.tensor(case[f"{c}_grid"]), mm_token_type_ids=(ids == 250).long())
        out[name] = {"case": c, "new_ids": _greedy(model, inputs)}
        print(name, out[name])
    (ROOT / "tests" / "fixtures" / "vlm" / "generate.json").write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
    decoders()
