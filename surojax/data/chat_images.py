"""Images in conversation rows: where they are, loading them from disk or data URLs, and the named errors.

Two layouts are read (both may not be mixed in one row):

* content parts, as OpenAI and transformers' processors take them: a message's `content` is a list of parts,
  `{"type": "text", "text": ...}`, `{"type": "image_url", "image_url": {"url": U}}` (or `"image_url": U`), and
  `{"type": "image", "image": U}` (also `"url"` / `"path"` instead of `"image"`);
* an `images: [U, ...]` column with `<image>` placeholders in the text (LLaVA / ShareGPT), or with bare
  `{"type": "image"}` parts (TRL's layout): each takes the next image, in message order; the counts must be equal.
  A column entry may also be encoded image bytes, a `datasets` Image dict {"bytes", "path"} or a PIL image.

U is a local path (relative paths resolve against `base_dir`, the dataset file's folder), a `file://` URL, or a
`data:image/...;base64,...` URL. Remote http(s) URLs are refused (nothing is downloaded). Either way the result is
the conversation with each image as a part `{"type": "image"}` at its place (the form transformers' processors pass
to the chat template: Qwen's templates write `<|vision_start|><|image_pad|><|vision_end|>` for it) and the images'
sources in order. `load_image` then opens one, checking the byte and pixel limits (`ImageLimits`) before decoding
the pixels (PIL reads the size from the header).

Every error is an `InvalidRowError` subclass (so skip_invalid_rows applies) whose message names the row index,
the image's number in the row and its file.
"""
from __future__ import annotations

import base64
import binascii
import io
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import unquote, urlparse

from PIL import Image, UnidentifiedImageError

from surojax.data.sources import InvalidRowError

PLACEHOLDER = "<image>"
IMAGE_PART_TYPES = ("image", "image_url")
VIDEO_PART_TYPES = ("video", "video_url")
_DATA_URL = re.compile(r"data:(image/[\w.+-]+)?(;[\w=.-]+)*;base64,", re.IGNORECASE)


ImageSource = str | bytes | Image.Image  # a path / file:// / data URL, encoded image bytes, or a decoded image


class ImageRowError(InvalidRowError):
    """A row whose images cannot be used; the message names the row, the image and its file."""


class RemoteImageError(ImageRowError):
    """An http(s) image URL: surojax reads images from local files and data URLs only."""


class MissingImageError(ImageRowError):
    """An image file that does not exist."""


class UnreadableImageError(ImageRowError):
    """A file or data URL that is not an image PIL can decode."""


class ImageTooLargeError(ImageRowError):
    """An image over `ImageLimits.max_pixels` or `ImageLimits.max_bytes`."""


class VideoRowError(InvalidRowError):
    """A row with a video (a video content part, a `videos` column): training rows take images only."""


class ImageLayoutError(ImageRowError):
    """Image parts or placeholders that do not fit the row's images (counts differ, malformed part, mixed)."""


@dataclass(frozen=True)
class ImageLimits:
    """Refuse images over these before decoding them: pixels = width * height as stored (before resizing), bytes
    of the file or of the decoded data URL."""
    max_pixels: int = 64 * 1024 * 1024
    max_bytes: int = 64 * 1024 * 1024

    def __post_init__(self):
        for name in ("max_pixels", "max_bytes"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(f"ImageLimits.{name} must be a positive integer, got {getattr(self, name)!r}")


def where(row: int | None, k: int | None = None) -> str:
    """"row 3, image 2" (1-based image number); without a row index (the caller names the row) "image 2" / "row"."""
    parts = ([f"row {row}"] if row is not None else []) + ([f"image {k + 1}"] if k is not None else [])
    return ", ".join(parts) or "row"


def _part_source(part: Mapping) -> str | None:
    """The URL / path of an image content part (None: a bare `{"type": "image"}` taking the images column's next)."""
    if part.get("type") == "image_url" or "image_url" in part:
        value = part.get("image_url")
        return value.get("url") if isinstance(value, Mapping) else value
    return next((part[key] for key in ("image", "url", "path") if part.get(key) is not None), None)


def _column_image(value, row: int | None, k: int) -> ImageSource:
    """An images-column entry: a path / URL string, a datasets Image dict {"bytes", "path"}, or a PIL image."""
    if isinstance(value, Mapping):
        value = value.get("bytes") if value.get("bytes") is not None else value.get("path")
    if isinstance(value, (bytes, Image.Image)) or (isinstance(value, str) and value):
        return value
    raise ImageLayoutError(f"{where(row, k)}: expected a path or URL string, image bytes or an image, got "
                           f"{type(value).__name__}")


def _is_image_part(part) -> bool:
    return isinstance(part, Mapping) and (part.get("type") in IMAGE_PART_TYPES or
                                          (part.get("type") is None and ("image" in part or "image_url" in part)))


VIDEOS_FIELD = "videos"  # the LLaVA / ms-swift column of video paths that `<video>` placeholders take


def row_video(row: Mapping) -> str | None:
    """What makes `row` a video row, in words ("a 'videos' column", "a video part ('video_url')"); None without one.
    Looks at the videos column and at the content parts of every list of messages in the row."""
    if row.get(VIDEOS_FIELD):
        return f"a {VIDEOS_FIELD!r} column"
    for value in row.values():
        if not isinstance(value, list):
            continue
        for m in value:
            content = m.get("content") if isinstance(m, Mapping) else None
            for part in content if isinstance(content, list) else ():
                if isinstance(part, Mapping) and (part.get("type") in VIDEO_PART_TYPES or "video" in part
                                                  or "video_url" in part):
                    return f"a video part ({part.get('type')!r})"
    return None


def has_images(messages: Sequence[Mapping], images: Sequence | None = None) -> bool:
    """Whether a conversation carries images (image parts, or a non-empty images column)."""
    if images:
        return True
    return any(isinstance(m.get("content"), list) and any(_is_image_part(p) for p in m["content"])
               for m in messages if isinstance(m, Mapping))


def _split_placeholders(text: str) -> list[dict]:
    parts: list[dict] = []
    for k, piece in enumerate(text.split(PLACEHOLDER)):
        if k:
            parts.append({"type": "image"})
        if piece:
            parts.append({"type": "text", "text": piece})
    return parts


def conversation_images(messages: Sequence[Mapping], images: Sequence | None = None, *,
                        row: int | None = None) -> tuple[list[dict], list[ImageSource]]:
    """(messages with each image as a `{"type": "image"}` part at its place, the images' sources in order).

    Without `images` (the row's images column) every image content part names its image. With it, each `<image>`
    in a text and each bare `{"type": "image"}` part (TRL's layout) takes the column's next image, and the counts
    must match. Text parts stay as they are; a message without images keeps its content."""
    if images is not None and not isinstance(images, (list, tuple)):
        raise ImageLayoutError(f"{where(row)}: the images column must be a list, got {type(images).__name__}")
    out: list[dict] = []
    sources: list[ImageSource] = []
    slots = 0  # images column slots: placeholders and bare image parts
    for m in messages:
        content = m.get("content")
        if isinstance(content, list):
            parts = []
            for part in content:
                if isinstance(part, Mapping) and (part.get("type") in VIDEO_PART_TYPES or "video" in part):
                    raise ImageLayoutError(f"{where(row)}: a video part ({part.get('type')!r}): videos are not "
                                           "supported in training rows yet, only images")
                if _is_image_part(part):
                    source = _part_source(part)
                    if images and source is not None:
                        raise ImageLayoutError(f"{where(row)}: the row has an images column and image parts that "
                                               "name their own image; use one layout")
                    if images:
                        slots += 1
                    elif not isinstance(source, str) or not source:
                        raise ImageLayoutError(
                            f"{where(row, len(sources))}: the image part {dict(part)!r} has no URL or path (expected "
                            "{'type': 'image_url', 'image_url': {'url': ...}} or {'type': 'image', 'image': ...}, or "
                            "an images column)")
                    else:
                        sources.append(source)
                    parts.append({"type": "image"})
                elif isinstance(part, Mapping) and images and PLACEHOLDER in str(part.get("text", "")):
                    split = _split_placeholders(part["text"])
                    slots += sum(p["type"] == "image" for p in split)
                    parts.extend(split)
                else:
                    parts.append(part)
            out.append({**m, "content": parts})
        elif isinstance(content, str) and images and PLACEHOLDER in content:
            split = _split_placeholders(content)
            slots += sum(p["type"] == "image" for p in split)
            out.append({**m, "content": split})
        else:
            out.append(dict(m))
    if images:
        if slots != len(images):
            raise ImageLayoutError(f"{where(row)}: {len(images)} images in the images column but {slots} "
                                   f"{PLACEHOLDER} placeholders / image parts in the messages (each takes the next "
                                   "image; the counts must be equal)")
        sources = [_column_image(value, row, k) for k, value in enumerate(images)]
    return out, sources


def _shown(source: str) -> str:
    """A source for an error message (data URLs cut short)."""
    return source if not source.lower().startswith("data:") else source[:40] + "..."


def read_image_bytes(source: str, *, base_dir: str | Path | None = None, limits: ImageLimits = ImageLimits(),
                     row: int | None = None, k: int | None = None) -> tuple[bytes, str]:
    """(the encoded image's bytes, the file it came from or "data URL"); refuses remote URLs, missing files and
    files over `limits.max_bytes` by name."""
    at = where(row, k)
    lowered = source[:16].lower()
    if lowered.startswith(("http://", "https://")):
        raise RemoteImageError(f"{at}: {source} is a remote URL; surojax does not download images (use a local "
                               "path, a file:// URL or a data:image/...;base64 URL)")
    if lowered.startswith("data:"):
        match = _DATA_URL.match(source)
        if match is None:
            raise UnreadableImageError(f"{at}: {_shown(source)} is a data URL but not data:image/...;base64,...")
        if (len(source) - match.end()) * 3 // 4 > limits.max_bytes:
            raise ImageTooLargeError(f"{at}: the data URL holds over {limits.max_bytes} bytes (max_bytes)")
        try:
            return base64.b64decode(source[match.end():], validate=True), "data URL"
        except (binascii.Error, ValueError) as e:
            raise UnreadableImageError(f"{at}: {_shown(source)}: invalid base64 ({e})") from None
    if lowered.startswith("file:"):
        parsed = urlparse(source)
        if parsed.netloc not in ("", "localhost"):
            raise RemoteImageError(f"{at}: {source} names the host {parsed.netloc!r}; only local files are read")
        path = Path(unquote(parsed.path))
    elif "://" in source[:12]:
        raise RemoteImageError(f"{at}: {source}: only local paths, file:// and data: URLs are read")
    else:
        path = Path(source).expanduser()
        if not path.is_absolute() and base_dir is not None:
            path = Path(base_dir) / path
    if not path.is_file():
        raise MissingImageError(f"{at}: image file {path} does not exist")
    size = path.stat().st_size
    if size > limits.max_bytes:
        raise ImageTooLargeError(f"{at}: image file {path} has {size} bytes, over the limit of "
                                 f"{limits.max_bytes} (max_bytes)")
    return path.read_bytes(), str(path)


def load_image(source: ImageSource, *, base_dir: str | Path | None = None, limits: ImageLimits = ImageLimits(),
               row: int | None = None, k: int | None = None) -> Image.Image:
    """The decoded image of a path / file:// / data URL / encoded bytes (or a decoded image itself), checked
    against `limits` (pixels from the header, before the pixels are decoded)."""
    at = where(row, k)
    if isinstance(source, Image.Image):
        if source.width * source.height > limits.max_pixels:
            raise ImageTooLargeError(f"{at}: the image is {source.width}x{source.height} = "
                                     f"{source.width * source.height} pixels, over the limit of {limits.max_pixels} "
                                     "(max_pixels)")
        return source
    if isinstance(source, bytes):
        if len(source) > limits.max_bytes:
            raise ImageTooLargeError(f"{at}: the image bytes ({len(source)}) are over the limit of "
                                     f"{limits.max_bytes} (max_bytes)")
        data, name = source, "the image bytes"
    else:
        data, name = read_image_bytes(source, base_dir=base_dir, limits=limits, row=row, k=k)
    try:
        with Image.open(io.BytesIO(data)) as probe:
            width, height = probe.size
            if width * height > limits.max_pixels:
                raise ImageTooLargeError(f"{at}: image {name} is {width}x{height} = {width * height} pixels, over "
                                         f"the limit of {limits.max_pixels} (max_pixels)")
            probe.load()
            return probe.copy()
    except ImageTooLargeError:
        raise
    except Image.DecompressionBombError as e:
        raise ImageTooLargeError(f"{at}: image {name}: {e}") from None
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError) as e:
        raise UnreadableImageError(f"{at}: {name} is not an image PIL can read ({type(e).__name__}: {e})"
                                   ) from None
