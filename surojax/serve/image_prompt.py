"""A chat request's images -> the prompt ids with their image tokens, the pixels for the vision encoder, and a
content hash per image for the prefix cache (the host side of serving a vision-language model).

    messages with image parts --chat_images.conversation_images--> {"type": "image"} parts + sources in order
        --image_bytes--> encoded bytes (data: URL, file:// URL, local path; http(s) only when allowed, via httpx)
        --load_image / preprocess_image--> pixel_values [P, D] float32, image_grid_thw [n, 3] int64
        --chat template + expand_image_tokens--> ids with each <|image_pad|> repeated for its image
        --VisionData.rope_positions--> M-RoPE positions [3, len(ids)] and rope_delta (decode positions)

`prompt_with_images(messages, tokenizer, vision, ...)` is what the engine integrator calls; `surojax generate
--image PATH` (cli/generate.py) builds its messages with `image_messages` and calls the same function. Each
image's hash is sha256 over its decoded pixels (mode, size, raw RGB bytes), so the same picture sent as a PNG
file and as a data URL keys the same prefix-cache entry; the prefix cache must mix these hashes into the key of
every block that holds that image's tokens (the ids alone are the same pad token for every image).

Errors are `ImagePromptError`s (a 400 for the server) naming the message, the image and the cause; a remote URL
without `allow_remote` names the server flag that allows it (`--allow-remote-images`).
"""
from __future__ import annotations

import hashlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import httpx
import numpy as np

from surojax.data.chat_images import (ImageLimits, ImageRowError, conversation_images, has_images, load_image,
                                      read_image_bytes)
from surojax.data.image_patches import ImagePreprocessError, image_token_count, preprocess_image
from surojax.data.image_rows import expand_image_tokens, image_token_id
from surojax.data.tokenizer import Tokenizer, TokenizerError
from surojax.data.vision_data import TextOnly, VisionData

REMOTE_FLAG = "--allow-remote-images"
REMOTE_TIMEOUT_S = 10.0

Fetch = Callable[[str, int], bytes]  # (http(s) URL, max bytes) -> the body


class ImagePromptError(ValueError):
    """A request whose images cannot be used (a client error: HTTP 400); the message names which and why."""


@dataclass(frozen=True)
class ImagePrompt:
    """A prompt with images, ready for the engine's prefill:
    ids             the prompt's token ids, each image as image_token_count(grid) image pad tokens
    pixel_values    [sum of patches, C * T * P * P] float32, the images in prompt order (the processor's layout)
    image_grid_thw  [n, 3] int64 (t, h, w) patches per image
    image_spans     (first token, token count) of each image in `ids`
    image_hashes    sha256 hex of each image's decoded pixels (prefix-cache key material)
    rope_positions  [3, len(ids)] int32 M-RoPE positions of the prompt
    rope_delta      the position of prompt token i + k (k >= 0 after the prompt) is len(ids) + k + rope_delta on
                    all three axes (transformers' rope_deltas)"""
    ids: list[int]
    pixel_values: np.ndarray
    image_grid_thw: np.ndarray
    image_spans: tuple[tuple[int, int], ...]
    image_hashes: tuple[str, ...]
    rope_positions: np.ndarray
    rope_delta: int


def messages_have_images(messages: Sequence[Mapping]) -> bool:
    """Whether chat messages carry image parts (`image_url` / `image`)."""
    return has_images([m for m in messages if isinstance(m, Mapping)])


def fetch_with_httpx(url: str, max_bytes: int) -> bytes:
    """GET an http(s) image URL (redirects followed, REMOTE_TIMEOUT_S), refusing a body over `max_bytes`."""
    try:
        with httpx.stream("GET", url, follow_redirects=True, timeout=REMOTE_TIMEOUT_S) as response:
            response.raise_for_status()
            body = bytearray()
            for chunk in response.iter_bytes():
                body += chunk
                if len(body) > max_bytes:
                    raise ImagePromptError(f"{url}: the image is over {max_bytes} bytes")
            return bytes(body)
    except httpx.HTTPError as e:
        raise ImagePromptError(f"{url}: cannot fetch the image ({type(e).__name__}: {e})") from None


def image_bytes(source: str, k: int, *, allow_remote: bool, fetch: Fetch, limits: ImageLimits) -> bytes:
    """The encoded bytes of image k's source: a data: URL, a file:// URL or a local path; an http(s) URL only when
    `allow_remote` (else an error naming REMOTE_FLAG)."""
    if source[:8].lower().startswith(("http://", "https://")):
        if not allow_remote:
            raise ImagePromptError(f"image {k + 1}: {source[:200]} is a remote URL; this server does not fetch "
                                   f"images (start it with {REMOTE_FLAG}), send a data:image/...;base64 URL instead")
        return fetch(source, limits.max_bytes)
    try:
        data, _ = read_image_bytes(source, limits=limits, k=k)
    except ImageRowError as e:
        raise ImagePromptError(str(e)) from None
    return data


def pixel_hash(image) -> str:
    """sha256 hex of a decoded image's mode, size and raw pixels."""
    h = hashlib.sha256(f"{image.mode}:{image.width}x{image.height}:".encode())
    h.update(image.tobytes())
    return h.hexdigest()


def prompt_with_images(messages: Sequence[Mapping], tokenizer: Tokenizer, vision: VisionData | TextOnly, *,
                       tools=None, template_kwargs: Mapping | None = None, add_generation_prompt: bool = True,
                       allow_remote: bool = False, fetch: Fetch = fetch_with_httpx,
                       limits: ImageLimits = ImageLimits()) -> ImagePrompt:
    """Chat messages with image parts (OpenAI's `{"type": "image_url", "image_url": {"url": ...}}`, or `{"type":
    "image", "image": ...}`) -> ImagePrompt; see the module docstring. A text-only model (`vision` a TextOnly) is
    refused by name."""
    if isinstance(vision, TextOnly):
        raise ImagePromptError(f"the request has images but {vision.reason}: it cannot take images")
    try:
        parts, sources = conversation_images(messages)
    except ImageRowError as e:
        raise ImagePromptError(str(e).replace("row: ", "messages: ", 1)) from None
    patches, grids, hashes = [], [], []
    for k, source in enumerate(sources):
        try:
            image = load_image(image_bytes(source, k, allow_remote=allow_remote, fetch=fetch, limits=limits),
                               limits=limits, k=k)
            p, grid = preprocess_image(image, vision.processing)
        except (ImageRowError, ImagePreprocessError) as e:
            raise ImagePromptError(f"image {k + 1}: {e}" if isinstance(e, ImagePreprocessError) else str(e)) from None
        patches.append(p)
        grids.append(grid)
        hashes.append(pixel_hash(image))
    grid_array = np.asarray(grids, np.int64).reshape(-1, 3)
    try:
        image_id = image_token_id(tokenizer)
        ids = tokenizer.apply_chat_template(parts, add_generation_prompt=add_generation_prompt, tools=tools,
                                            tokenize=True, **dict(template_kwargs or {}))
    except TokenizerError as e:
        raise ImagePromptError(str(e)) from None
    counts = [image_token_count(g, vision.processing.merge_size) for g in grid_array]
    try:
        expanded, _, spans = expand_image_tokens(ids, [False] * len(ids), counts, image_id)
        positions = vision.rope_positions(expanded, grid_array)
    except (ImageRowError, ValueError) as e:
        raise ImagePromptError(f"the chat template's image tokens: {e}") from None
    width = 3 * vision.processing.temporal_patch_size * vision.processing.patch_size ** 2
    pixels = np.concatenate(patches) if patches else np.zeros((0, width), np.float32)
    return ImagePrompt(expanded.tolist(), pixels, grid_array, spans, tuple(hashes), positions,
                       int(positions.max()) + 1 - len(expanded) if len(expanded) else 0)


def image_messages(prompt: str, images: Sequence[str], *, system: str | None = None) -> list[dict]:
    """`surojax generate --image PATH ... --prompt TEXT`: one user message with the images first, then the text
    (the order Qwen's model cards use), after an optional system message."""
    content = [{"type": "image_url", "image_url": {"url": path}} for path in images]
    content.append({"type": "text", "text": prompt})
    return ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": content}]
