"""`surojax tokenize train.yaml --debug`: print examples token by token, marking the tokens that carry loss.

Each token is printed as its text followed by its id in parentheses; supervised tokens (mask True: the model
is trained to produce them) in green, the others dimmed. A token holding a line break is shown as "\\n" and
followed by a real line break, so the layout of the chat template stays readable. Without colour (a pipe,
NO_COLOR) supervised tokens are wrapped in «...». An image's pad tokens (an ImageExample's `image_spans`) are
shown as one label, `<image 1: 16x24 patches -> 96 tokens>`, instead of 96 pad tokens, and the example's image
sources are listed under its rule (`images: a.png, b.png`; data URLs cut short, bytes by their size).
"""
from __future__ import annotations

from collections.abc import Sequence

from rich.console import Console
from rich.text import Text

from surojax.data.formats import Example
from surojax.data.tokenizer import Tokenizer

SUPERVISED, PROMPT, ID = "bold green", "dim", "cyan"


def image_labels(spans: Sequence[tuple[int, int]], grids: Sequence[Sequence[int]]) -> dict[int, tuple[int, str]]:
    """{first token: (token count, label)} of each image span, e.g. `<image 1: 16x24 patches -> 96 tokens>`."""
    labels = {}
    for k, ((start, n), (t, h, w)) in enumerate(zip(spans, grids), 1):
        patches = f"{int(h)}x{int(w)}" if int(t) == 1 else f"{int(t)}x{int(h)}x{int(w)}"
        labels[int(start)] = (int(n), f"<image {k}: {patches} patches -> {int(n)} tokens>")
    return labels


def source_label(source) -> str:
    """An image source as shown by --debug: a path as given, a data URL cut short, bytes / a decoded image by size."""
    if isinstance(source, str):
        return source if not source.lower().startswith("data:") else source[:32] + "..."
    if isinstance(source, bytes):
        return f"<{len(source)} bytes>"
    size = getattr(source, "size", None)
    return f"<image {size[0]}x{size[1]}>" if size else f"<{type(source).__name__}>"


def example_text(ids: Sequence[int], mask: Sequence[bool], tokenizer: Tokenizer, *, color: bool = True,
                 images: dict[int, tuple[int, str]] | None = None) -> Text:
    """A rich Text of one example: each token as text(id), supervised ones highlighted; `images` (image_labels)
    replaces each image's pad tokens by its label."""
    out = Text()
    skip_to = 0
    for t, (tid, sup) in enumerate(zip(ids, mask)):
        if t < skip_to:
            continue
        if images and t in images:
            n, label = images[t]
            out.append(label, style=ID)
            skip_to = t + n
            continue
        piece = tokenizer.decode([int(tid)])
        shown = piece.replace("\n", "\\n").replace("\t", "\\t")
        if not color and sup:
            shown = f"«{shown}»"
        out.append(shown, style=SUPERVISED if sup else PROMPT)
        out.append(f"({int(tid)})", style=ID if sup else PROMPT)
        if piece.endswith("\n"):
            out.append("\n")
    return out


def debug_print(examples: Sequence[Example | tuple], tokenizer: Tokenizer, n: int = 3,
                console: Console | None = None) -> None:
    """Print the first `n` examples (Example or (ids, mask) pairs) token by token, marking supervised tokens."""
    console = console or Console()
    color = console.color_system is not None
    legend = Text("legend: ")
    legend.append("supervised(id)" if color else "«supervised»(id)", style=SUPERVISED)
    legend.append("  ")
    legend.append("not supervised(id)", style=PROMPT)
    console.print(legend)
    for k, ex in enumerate(list(examples)[:n]):
        ids, mask = (ex.ids, ex.mask) if isinstance(ex, Example) else ex
        console.rule(f"example {k}: {len(ids)} tokens, {int(sum(map(bool, mask)))} supervised")
        images = image_labels(getattr(ex, "image_spans", ()), getattr(ex, "image_grid_thw", ()))
        if getattr(ex, "images", ()):
            console.print("images: " + ", ".join(source_label(s) for s in ex.images), highlight=False,
                          soft_wrap=True)
        console.print(example_text(ids, mask, tokenizer, color=color, images=images), soft_wrap=True,
                      highlight=False)
