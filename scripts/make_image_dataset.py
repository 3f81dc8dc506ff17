"""The example image dataset: shapes, colours and digits drawn with Pillow, with chat rows asking about them.

Run from the surojax venv (it needs only Pillow):

    python scripts/make_image_dataset.py            # writes examples/data/images/

What is written (committed, ~45 KB, so the vision-language example needs no download; a re-run rewrites the same
bytes: fixed seed, PNGs saved without timestamps):

    examples/data/images/img/*.png     a filled circle / square / triangle / diamond in one of six colours on a
                                       light background, and digits 0-9 drawn large in a colour, at several sizes
                                       (64x64, 96x64, 64x112, 128x96, 80x80: odd aspect ratios on purpose)
    examples/data/images/train.jsonl   {"messages": [user: [image_url part {"url": "img/NAME.png"}, text question],
                                       assistant: answer]}: "What shape and colour is this?" -> "A red circle.",
                                       "Which digit is this, and in what colour?" -> "The digit 7, in blue."; a few
                                       rows use the `images` column + `<image>` layout and a few compare two images
    examples/data/images/test.jsonl    held-out rows of the same kinds (no (shape, colour, size) image of the test
                                       set is in train.jsonl)

Relative image paths resolve against the .jsonl file's folder (surojax/data/image_rows.py dataset_image_dir).
"""
from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

from PIL import Image, ImageDraw, ImageFont

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "examples" / "data" / "images"
SEED = 41
COLOURS = {"red": (220, 40, 40), "green": (40, 160, 60), "blue": (40, 80, 220), "yellow": (230, 200, 30),
           "purple": (140, 60, 180), "orange": (240, 130, 30)}
SHAPES = ("circle", "square", "triangle", "diamond")
SIZES = ((64, 64), (96, 64), (64, 112), (128, 96), (80, 80))
BACKGROUND = (245, 245, 240)
SHAPE_QUESTIONS = ("What shape and colour is this?", "Describe the shape in the picture.",
                   "Which shape is shown, and what colour is it?")
DIGIT_QUESTIONS = ("Which digit is this, and in what colour?", "What number is written here?")


def draw_shape(shape: str, colour: str, size: tuple[int, int], rng: random.Random) -> Image.Image:
    w, h = size
    image = Image.new("RGB", size, BACKGROUND)
    draw = ImageDraw.Draw(image)
    side = int(min(w, h) * rng.uniform(0.55, 0.8))
    x0, y0 = rng.randint(2, w - side - 2), rng.randint(2, h - side - 2)
    box = (x0, y0, x0 + side, y0 + side)
    fill = COLOURS[colour]
    if shape == "circle":
        draw.ellipse(box, fill=fill)
    elif shape == "square":
        draw.rectangle(box, fill=fill)
    elif shape == "triangle":
        draw.polygon([(x0 + side / 2, y0), (x0, y0 + side), (x0 + side, y0 + side)], fill=fill)
    else:
        draw.polygon([(x0 + side / 2, y0), (x0 + side, y0 + side / 2), (x0 + side / 2, y0 + side),
                      (x0, y0 + side / 2)], fill=fill)
    return image


def draw_digit(digit: int, colour: str, size: tuple[int, int]) -> Image.Image:
    image = Image.new("RGB", size, BACKGROUND)
    draw = ImageDraw.Draw(image)
    font = ImageFont.load_default(size=int(min(size) * 0.8))
    draw.text((size[0] / 2, size[1] / 2), str(digit), fill=COLOURS[colour], font=font, anchor="mm")
    return image


def row(images: list[str], question: str, answer: str, *, column: bool = False) -> dict:
    if column:  # the LLaVA / ShareGPT layout: an images column and <image> placeholders
        return {"images": images, "messages": [{"role": "user", "content": "<image>" * len(images) + question},
                                               {"role": "assistant", "content": answer}]}
    parts = [{"type": "image_url", "image_url": {"url": u}} for u in images]
    return {"messages": [{"role": "user", "content": [*parts, {"type": "text", "text": question}]},
                         {"role": "assistant", "content": answer}]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args()
    rng = random.Random(SEED)
    img_dir = args.out / "img"
    img_dir.mkdir(parents=True, exist_ok=True)
    shapes = []  # (file, shape, colour)
    for shape in SHAPES:
        for colour in COLOURS:
            size = SIZES[rng.randrange(len(SIZES))]
            name = f"{colour}_{shape}_{size[0]}x{size[1]}.png"
            draw_shape(shape, colour, size, rng).save(img_dir / name, optimize=True)
            shapes.append((f"img/{name}", shape, colour))
    digits = []  # (file, digit, colour)
    for digit in range(10):
        colour = rng.choice(sorted(COLOURS))
        size = SIZES[rng.randrange(len(SIZES))]
        name = f"digit_{digit}_{colour}_{size[0]}x{size[1]}.png"
        draw_digit(digit, colour, size).save(img_dir / name, optimize=True)
        digits.append((f"img/{name}", digit, colour))
    rng.shuffle(shapes)
    rng.shuffle(digits)
    held_shapes, held_digits = set(shapes[:4]), set(digits[:2])
    train, test = [], []
    for item in shapes:
        path, shape, colour = item
        rows = [row([path], q, f"A {colour} {shape}.", column=k == 2) for k, q in enumerate(SHAPE_QUESTIONS)]
        (test if item in held_shapes else train).extend(rows)
    for item in digits:
        path, digit, colour = item
        rows = [row([path], DIGIT_QUESTIONS[0], f"The digit {digit}, in {colour}."),
                row([path], DIGIT_QUESTIONS[1], f"{digit}.")]
        (test if item in held_digits else train).extend(rows)
    seen = [s for s in shapes if s not in held_shapes]
    for _ in range(12):  # two images in one question
        (a, sa, ca), (b, sb, cb) = rng.sample(seen, 2)
        same = "Yes" if sa == sb else "No"
        train.append(row([a, b], "Do these two pictures show the same shape?",
                         f"{same}: the first is a {ca} {sa}, the second a {cb} {sb}."))
    rng.shuffle(train)
    for name, rows in (("train.jsonl", train), ("test.jsonl", test)):
        (args.out / name).write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    total = sum(f.stat().st_size for f in args.out.rglob("*") if f.is_file())
    print(f"{args.out}: {len(shapes) + len(digits)} images, {len(train)} train rows, {len(test)} test rows, "
          f"{total / 1024:.0f} KB")


if __name__ == "__main__":
    main()
