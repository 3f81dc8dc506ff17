"""Every command's --help says only what works: no promised formats or commands that are not there, every listed
command is built (its module loads and its --help runs), and every `quantize --type` choice writes its file type."""
import re

import pytest

from surojax.cli.main import COMMANDS, load_command, main

# Promises the help once made that the code does not keep (issue 14 item 8), per help page (None: the listing).
# NF4 / FP8 / NVFP4 are real for training (`bench --quant`, qlora_* configs), not as quantize outputs.
FALSE_PROMISES = {None: ("nf4", "nvfp4", "or GGUF", "(and adapters)"), "quantize": ("nf4", "fp8", "nvfp4"),
                  "export": ("GGUF",), "generate": ("(and adapters)",)}
MISSING = ("not available", "not implemented", "not built")  # what a listed command must never say of itself


def help_text(capsys, *argv: str) -> str:
    assert main([*argv, "--help"]) == 0
    return capsys.readouterr().out


@pytest.mark.parametrize("name", FALSE_PROMISES)
def test_help_makes_no_false_promise(capsys, name):
    text = help_text(capsys, *([name] if name else []))
    assert text.strip()
    for promise in FALSE_PROMISES[name]:
        assert promise not in text, f"`surojax {name or ''} --help` promises {promise!r}"


def test_every_listed_command_is_built(capsys):
    """Each command in the listing has its module (add_arguments, run) and a --help that runs; neither the listing
    nor a command's own help says it is missing (the listing once said so of DPO, which was built)."""
    def squeezed(text: str) -> str:  # argparse wraps lines at spaces and hyphens
        return "".join(text.split())

    listing = help_text(capsys)
    for name, line in COMMANDS.items():
        assert re.search(rf"^\s+{re.escape(name)}\s", listing, re.M) and squeezed(line) in squeezed(listing), name
        module = load_command(name)
        assert callable(module.add_arguments) and callable(module.run), name
        own = help_text(capsys, name)
        assert squeezed(line) in squeezed(own), name
        for text in (line, own):
            assert not any(m in text for m in MISSING), (name, text)


def test_generate_help_names_what_it_loads(capsys):
    text = " ".join(help_text(capsys, "generate").split())
    for kind in ("HF model folder", ".gguf file", "surojax output folder", "PEFT adapter folder", "Hub id"):
        assert kind in text


def quantize_choices(capsys) -> list[str]:
    assert main(["quantize", "--model", "m", "--output", "o.gguf", "--type", "not-a-type"]) == 2
    err = " ".join(capsys.readouterr().err.split())
    return [c.strip("' ") for c in err.split("(choose from ")[1].rstrip(")").split(",")]


def test_quantize_offers_only_gguf_file_types(capsys):
    gguf = pytest.importorskip("gguf")
    choices = quantize_choices(capsys)
    assert choices and "nf4" not in choices
    names = {m.name for m in gguf.LlamaFileType}
    for c in choices:  # each is one of llama.cpp's file types
        assert ("ALL_F32" if c == "f32" else f"MOSTLY_{c.upper()}") in names, c


@pytest.mark.slow
def test_every_quantize_type_writes_its_file_type(capsys, tmp_path):
    gguf = pytest.importorskip("gguf")
    from tests.weights.gguf_tiny import tiny_model_dir

    model = tiny_model_dir("llama", tmp_path / "m")
    for c in quantize_choices(capsys):
        out = tmp_path / f"{c}.gguf"
        assert main(["quantize", "--model", str(model), "--output", str(out), "--type", c]) == 0, c
        want = gguf.LlamaFileType.ALL_F32 if c == "f32" else gguf.LlamaFileType[f"MOSTLY_{c.upper()}"]
        assert gguf.GGUFReader(out).fields["general.file_type"].contents() == int(want), c
