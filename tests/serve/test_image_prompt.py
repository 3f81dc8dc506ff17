"""Request-side images (surojax/serve/image_prompt.py): chat messages with image_url parts -> prompt ids equal to
transformers' Qwen3VLProcessor (tests/fixtures/vision_chat), pixels, per-image content hashes, M-RoPE positions;
remote URLs refused unless allowed; a text-only model refused by name; `generate --image` messages."""
from __future__ import annotations

import base64
import json
from pathlib import Path

import numpy as np
import pytest

from surojax.data.image_patches import ImageProcessing
from surojax.data.tokenizer import Tokenizer
from surojax.data.vision_data import TextOnly, VisionData
from surojax.models.vision.mrope import mrope_positions
from surojax.serve.image_prompt import ImagePromptError, image_messages, prompt_with_images

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "vision_chat"
EXPECTED = json.loads((FIXTURE / "expected.json").read_text())
PIXELS = np.load(FIXTURE / "expected.npz")


@pytest.fixture(scope="module")
def tok():
    return Tokenizer.from_dir(FIXTURE)


@pytest.fixture(scope="module")
def vision(tok):
    proc = ImageProcessing.from_config(json.loads((FIXTURE / "preprocessor_config.json").read_text()))
    return VisionData(proc, tok.token_to_id("<|image_pad|>"), tok.token_to_id("<|video_pad|>"),
                      tok.token_to_id("<|vision_start|>"), "qwen3_vl")


def _data_url(name: str) -> str:
    return "data:image/png;base64," + base64.b64encode((FIXTURE / name).read_bytes()).decode()


def _messages(first: str, second: str) -> list[dict]:
    """The fixture's two_images conversation, as an OpenAI client sends it (image_url parts)."""
    return [{"role": "system", "content": "You compare pictures."},
            {"role": "user", "content": [{"type": "text", "text": "First "},
                                         {"type": "image_url", "image_url": {"url": first}},
                                         {"type": "text", "text": " then "},
                                         {"type": "image_url", "image_url": {"url": second}},
                                         {"type": "text", "text": " differ?"}]},
            {"role": "assistant", "content": [{"type": "text", "text": "Yes, they differ."}]},
            {"role": "user", "content": "Why?"}, {"role": "assistant", "content": "Colours."}]


def test_image_url_parts_give_the_processors_ids_pixels_and_positions(tok, vision):
    exp = EXPECTED["two_images"]
    got = prompt_with_images(_messages((FIXTURE / "img_a.png").as_uri(), _data_url("img_b.png")), tok, vision,
                             add_generation_prompt=False)
    assert got.ids == exp["input_ids"] and got.image_grid_thw.tolist() == exp["image_grid_thw"]
    np.testing.assert_array_equal(got.pixel_values, PIXELS["two_images_pixel_values"])
    want, delta = mrope_positions(np.asarray([got.ids]), got.image_grid_thw, image_token_id=vision.image_token_id,
                                  video_token_id=vision.video_token_id,
                                  vision_start_token_id=vision.vision_start_token_id, spatial_merge_size=2)
    np.testing.assert_array_equal(got.rope_positions, want[:, 0])
    assert got.rope_delta == int(delta[0])
    pad = vision.image_token_id
    assert all(got.ids[s:s + n] == [pad] * n for s, n in got.image_spans)
    # the same pixels sent as a plain path and as a data URL hash alike; different pixels differently
    same = prompt_with_images(_messages(_data_url("img_a.png"), str(FIXTURE / "img_b.png")), tok, vision)
    assert same.image_hashes == got.image_hashes and len(set(got.image_hashes)) == 2
    assert same.ids[-3:] == tok.encode("<|im_start|>assistant\n")[-3:]


def test_remote_urls_refused_unless_allowed_then_fetched(tok, vision):
    url = "https://example.com/cat.png"
    messages = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                             {"type": "text", "text": "What?"}]}]
    with pytest.raises(ImagePromptError, match="--allow-remote-images"):
        prompt_with_images(messages, tok, vision)
    asked = []

    def fetch(u: str, max_bytes: int) -> bytes:
        asked.append(u)
        return (FIXTURE / "img_b.png").read_bytes()

    got = prompt_with_images(messages, tok, vision, allow_remote=True, fetch=fetch)
    assert asked == [url] and got.image_grid_thw.tolist() == [EXPECTED["two_images"]["image_grid_thw"][1]]


@pytest.mark.parametrize("url, text", [("/no/such/file.png", "does not exist"),
                                       ("data:image/png;base64,AAAA", "not an image"),
                                       ("ftp://host/x.png", "only local paths")])
def test_bad_images_are_named_errors(tok, vision, url, text):
    messages = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}}]}]
    with pytest.raises(ImagePromptError, match=text):
        prompt_with_images(messages, tok, vision)


def test_text_only_model_refuses_images_by_name(tok):
    messages = image_messages("What?", [str(FIXTURE / "img_a.png")])
    with pytest.raises(ImagePromptError, match="the request has images but m is a text model"):
        prompt_with_images(messages, tok, TextOnly("m is a text model"))


def test_generate_image_messages(tok, vision):
    messages = image_messages("Describe.", [str(FIXTURE / "img_a.png"), str(FIXTURE / "img_b.png")],
                              system="Be brief.")
    got = prompt_with_images(messages, tok, vision)
    assert len(got.image_hashes) == 2 and len(got.image_spans) == 2
    text = tok.decode(got.ids)
    assert text.index("<|vision_start|>") < text.index("Describe.") and text.startswith("<|im_start|>system")


def test_serve_flag_allows_remote_images():
    from tests.serve.live_server import parse_serve_args
    assert parse_serve_args(["--allow-remote-images"]).allow_remote_images
    assert not parse_serve_args([]).allow_remote_images


def test_allowed_remote_urls_are_fetched_with_httpx_within_the_byte_limit(tok, vision):
    """The default fetch (httpx) against a local HTTP server holding the fixture images; a body over max_bytes and
    a 404 are named errors."""
    import functools
    import http.server
    import threading

    from surojax.data.chat_images import ImageLimits

    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(FIXTURE))
    handler.log_message = lambda *a: None
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    base = f"http://127.0.0.1:{server.server_address[1]}"

    def ask(name: str) -> list[dict]:
        return image_messages("What?", [f"{base}/{name}"])

    try:
        got = prompt_with_images(ask("img_b.png"), tok, vision, allow_remote=True)
        local = prompt_with_images(image_messages("What?", [str(FIXTURE / "img_b.png")]), tok, vision)
        assert got.image_hashes == local.image_hashes and got.ids == local.ids
        with pytest.raises(ImagePromptError, match="over 100 bytes"):
            prompt_with_images(ask("img_b.png"), tok, vision, allow_remote=True, limits=ImageLimits(max_bytes=100))
        with pytest.raises(ImagePromptError, match="cannot fetch the image.*404"):
            prompt_with_images(ask("absent.png"), tok, vision, allow_remote=True)
    finally:
        server.shutdown()
