"""Check that transformers loads folders written by `surojax.weights.save_model` and gives the expected logits.

Run with the reference environment (torch + transformers), never from the surojax venv:

    /work/refenv/bin/python scripts/check_transformers_load.py SAVED_DIR[=EXPECTED.npz] ...

For each folder: `AutoConfig` / `AutoModelForCausalLM.from_pretrained(dir, dtype=float32,
attn_implementation="eager")` with `output_loading_info=True`; then the logits of `tokens0..2` from EXPECTED.npz
(default: DIR/expected.npz, as in tests/fixtures/models/<name>/) are compared with its `logits0..2`, and greedy
decoding of `greedy_prompt` with `greedy_tokens` (unless --no-greedy). Prints one JSON line per folder:

    {"dir", "model_type", "architecture", "rope_parameters", "attention_bias" (q/k/v/o bias present),
     "tie_word_embeddings", "sliding_window", "missing_keys", "unexpected_keys", "mismatched_keys", "warnings",
     "max_abs_diff", "greedy_equal" (null with --no-greedy), "ok"}

`ok` is true when loading reported no missing / unexpected / mismatched keys and no warnings about the config,
max_abs_diff <= --tol (the weights are the fixture's bits, so HF's own logits come back up to summation order:
another CPU's vector width reorders the fp32 sums; default: `reorder_tolerance`, 6 standard deviations of the
rounding difference of the longest sum at the logits' scale, as tests/tolerances.py derives it) and the
greedy tokens (when decoded) are equal. Exit status 0 when every folder is ok, 1 otherwise.
"""
from __future__ import annotations

import argparse
import json
import logging
import math
import sys
import warnings
from pathlib import Path

import numpy as np


class _Capture(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record):
        self.messages.append(record.getMessage())


def reorder_tolerance(config, logits_scale: float, sigmas: float = 6.0) -> float:
    """sigmas * sqrt(2K) * u * scale: two fp32 results of length-K sums in different orders (Higham & Mary 2019),
    K the longest sum of the forward (hidden, MLP or expert width, attention heads x head_dim)."""
    k = max(int(getattr(config, name, 0) or 0) for name in ("hidden_size", "intermediate_size", "moe_intermediate_size"))
    k = max(k, int(getattr(config, "num_attention_heads", 0) or 0) * int(getattr(config, "head_dim", 0) or 0))
    return sigmas * math.sqrt(2 * k) * float(np.finfo(np.float32).eps / 2) * logits_scale


def check(model_dir: Path, expected: Path, tol: float | None, greedy: bool = True) -> dict:
    import torch
    import transformers
    from transformers import AutoConfig, AutoModelForCausalLM

    capture = _Capture()
    transformers.logging.get_logger("transformers").addHandler(capture)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        config = AutoConfig.from_pretrained(model_dir)
        # the class config.json names (a multimodal ConditionalGeneration model too), else the Auto class
        arch = getattr(transformers, (getattr(config, "architectures", None) or [""])[0], AutoModelForCausalLM)
        model, info = arch.from_pretrained(
            model_dir, dtype=torch.float32, attn_implementation="eager", output_loading_info=True)
    transformers.logging.get_logger("transformers").removeHandler(capture)
    model.eval()
    exp = np.load(expected)
    diffs = []
    with torch.no_grad():
        for i in range(3):
            tokens = torch.tensor(exp[f"tokens{i}"][None].astype(np.int64))
            logits = model(tokens).logits[0].float().numpy()
            diffs.append(float(np.abs(logits - exp[f"logits{i}"]).max()))
        if tol is None:
            tol = reorder_tolerance(config, max(float(np.abs(exp[f"logits{i}"]).max()) for i in range(3)))
        if greedy:
            prompt = torch.tensor(exp["greedy_prompt"][None].astype(np.int64))
            out = model.generate(prompt, attention_mask=torch.ones_like(prompt), do_sample=False,
                                 max_new_tokens=len(exp["greedy_tokens"]), eos_token_id=None, pad_token_id=0)
            greedy_equal = out[0, prompt.shape[1]:].tolist() == exp["greedy_tokens"].tolist()
    decoder = getattr(model.model, "language_model", model.model)  # the text model of a multimodal one
    attn = next(layer.self_attn for layer in decoder.layers if hasattr(layer, "self_attn"))  # hybrids: the 1st full
    report = {
        "dir": str(model_dir),
        "model_type": config.model_type,
        "architecture": type(model).__name__,
        "rope_parameters": getattr(config, "rope_parameters", None),
        "attention_bias": {p: getattr(attn, f"{p}_proj", None) is not None and getattr(attn, f"{p}_proj").bias
                           is not None or p == "o" and getattr(attn, "out_proj", None) is not None  # LFM2's o_proj
                           and attn.out_proj.bias is not None for p in "qkvo"},
        "tie_word_embeddings": bool(getattr(config, "tie_word_embeddings", False)),
        "sliding_window": getattr(config, "sliding_window", None),
        "missing_keys": sorted(info.get("missing_keys", [])),
        "unexpected_keys": sorted(info.get("unexpected_keys", [])),
        "mismatched_keys": [str(k) for k in info.get("mismatched_keys", [])],
        "warnings": [m for m in capture.messages + [str(w.message) for w in caught]
                     if any(s in m.lower() for s in ("rope", "config", "unrecognized", "ignored", "not used"))],
        "max_abs_diff": max(diffs),
        "tol": tol,
        "greedy_equal": greedy_equal if greedy else None,
    }
    report["ok"] = (not report["missing_keys"] and not report["unexpected_keys"] and not report["mismatched_keys"]
                    and not report["warnings"] and report["max_abs_diff"] <= tol and report["greedy_equal"] is not False)
    return report


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("dirs", nargs="+", metavar="DIR[=EXPECTED.npz]")
    ap.add_argument("--tol", type=float, default=None, help="max |logits - expected| (default: derived, see above)")
    ap.add_argument("--no-greedy", action="store_true", help="skip greedy decoding (about 1 s a model on CPU)")
    args = ap.parse_args(argv)
    ok = True
    for spec in args.dirs:
        d, _, npz = spec.partition("=")
        report = check(Path(d), Path(npz) if npz else Path(d) / "expected.npz", args.tol, not args.no_greedy)
        ok &= report["ok"]
        print(json.dumps(report), flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
