"""A byte-level BPE tokenizer <-> the `tokenizer.ggml.*` metadata of a GGUF file (what llama.cpp reads).

Writing follows llama.cpp's convert_hf_to_gguf `_set_vocab_gpt2`: tokenizer.ggml.model "gpt2", one token per
id up to the model's vocab size (ids the tokenizer lacks become "[PAD<i>]", type UNUSED), token types NORMAL /
CONTROL (added special tokens) / USER_DEFINED (other added tokens), merges as "a b" strings, bos / eos / pad
ids, add_bos_token, and the chat template. `tokenizer.ggml.pre` names the pre-tokenizer llama.cpp must use;
convert_hf_to_gguf finds it by hashing the ids of a fixed check text, and we do the same for the two families we
write (Qwen2/Qwen3 -> "qwen2", Llama 3 -> "llama-bpe"), then fall back on the tokenizer.json split regex itself
(the Qwen2 or Llama 3 pattern, as in small or retrained tokenizers), else "default".

Reading rebuilds a `tokenizers` BPE tokenizer from the same fields (the split regex of the named pre-tokenizer
+ ByteLevel, NFC for qwen2, ByteLevel decoder, a bos-prepending post-processor when add_bos_token) and wraps it
in surojax's `Tokenizer` with the special tokens and chat template. Only "gpt2" (byte-level BPE) vocabularies
are supported; SentencePiece ("llama") vocabularies raise a clear error.
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

import tokenizers
from tokenizers import decoders, models, normalizers, pre_tokenizers, processors

from surojax.data.tokenizer import Tokenizer
from surojax.weights.gguf_reader import GGUFError

QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
               r"\s*[\r\n]+|\s+(?!\S)|\s+")
LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
                r"\s*[\r\n]+|\s+(?!\S)|\s+")
PRE_SPLIT = {"qwen2": QWEN2_SPLIT, "llama-bpe": LLAMA3_SPLIT}
# convert_hf_to_gguf's check text and the hashes of the token ids it gives (Qwen1.5/2/2.5/3, Qwen3-Embedding,
# Meta-Llama-3)
CHECK_TEXT = ('\n \n\n \n\n\n \t \t\t \t\n  \n   \n    \n     \n🚀 (normal) 😶\u200d🌫️ (multiple emojis concatenated) ✅ '
              '🦙🦙 3 33 333 3333 33333 333333 3333333 33333333 3.3 3..3 3...3 កាន់តែពិសេសអាច😁 ?我想在apple工作1314151天～ '
              '------======= нещо на Български \'\'\'\'\'\'```````""""......!!!!!!?????? I\'ve been \'told he\'s there, '
              '\'RE you sure? \'M not sure I\'ll make it, \'D you like some tea? We\'Ve a\'lL')
KNOWN_HASHES = {"e636dc30a262dcc0d8c323492e32ae2b70728f4df7dfe9737d9f920a282b8aea": "qwen2",
                "d4540891389ea895b53b399da6ac824becc30f2fba0e9ddbb98f92e55ca0e97c": "qwen2",
                "0ef9807a4087ebef797fc749390439009c3b9eda9ad1a097abbe738f486c01e5": "llama-bpe"}
NORMAL, CONTROL, USER_DEFINED, UNUSED = 1, 3, 4, 5


class GGUFTokenizerError(GGUFError):
    """A tokenizer that cannot be written to GGUF, or tokenizer.ggml.* metadata that cannot be read back."""


def _split_regex(pre) -> str | None:
    if not isinstance(pre, dict):
        return None
    if pre.get("type") == "Split":
        return (pre.get("pattern") or {}).get("Regex")
    for p in pre.get("pretokenizers") or []:
        found = _split_regex(p)
        if found:
            return found
    return None


def pre_tokenizer_name(tok: Tokenizer, tokenizer_json: dict) -> str:
    """The `tokenizer.ggml.pre` value llama.cpp expects for this tokenizer (module docstring)."""
    ids = tok.backend.encode(CHECK_TEXT, add_special_tokens=True).ids
    name = KNOWN_HASHES.get(hashlib.sha256(str(ids).encode()).hexdigest())
    if name:
        return name
    regex = _split_regex(tokenizer_json.get("pre_tokenizer"))
    for name, pattern in PRE_SPLIT.items():
        if regex == pattern:
            return name
    return "default"


def tokenizer_metadata(tokenizer_dir, vocab_size: int) -> dict:
    """The tokenizer.ggml.* fields (and the chat template) for a HF tokenizer folder, as plain Python values."""
    tokenizer_dir = Path(tokenizer_dir)
    tok = Tokenizer.from_dir(tokenizer_dir)
    tj = json.loads((tokenizer_dir / "tokenizer.json").read_text(encoding="utf-8"))
    model = tj.get("model") or {}
    if model.get("type") != "BPE" or not _is_byte_level(tj):
        raise GGUFTokenizerError(f"{tokenizer_dir}/tokenizer.json: only byte-level BPE tokenizers (Llama 3, Qwen) "
                                 f"can be written to GGUF here; this one is {model.get('type')}")
    if tok.vocab_size > vocab_size:
        raise GGUFTokenizerError(f"{tokenizer_dir}: the tokenizer has {tok.vocab_size} tokens, more than the "
                                 f"model's vocab_size {vocab_size}")
    added = tok.backend.get_added_tokens_decoder()
    tokens, types = [], []
    for i in range(vocab_size):
        t = tok.backend.id_to_token(i)
        if t is None:
            tokens.append(f"[PAD{i}]")
            types.append(UNUSED)
        elif i in added:
            tokens.append(t)
            looks_special = t.startswith("<|") and t.endswith("|>")
            types.append(CONTROL if added[i].special or looks_special else USER_DEFINED)
        else:
            tokens.append(t)
            types.append(NORMAL)
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges") or []]
    bos = tok.bos_token_id
    probe = tok.backend.encode("a", add_special_tokens=True).ids
    add_bos = bool(bos is not None and probe and probe[0] == bos)
    template = tok.chat_template
    if isinstance(template, dict):
        template = template.get("default")
    return {"model": "gpt2", "pre": pre_tokenizer_name(tok, tj), "tokens": tokens, "token_type": types,
            "merges": merges, "bos_token_id": bos, "eos_token_id": tok.eos_token_id, "pad_token_id": tok.pad_token_id,
            "add_bos_token": add_bos, "add_eos_token": False, "chat_template": template}


def _is_byte_level(tj: dict) -> bool:
    return "ByteLevel" in json.dumps(tj.get("pre_tokenizer")) and "ByteLevel" in json.dumps(tj.get("decoder"))


def add_tokenizer(writer, meta: dict) -> None:
    """Write `tokenizer_metadata(...)` with a gguf.GGUFWriter."""
    writer.add_tokenizer_model(meta["model"])
    writer.add_tokenizer_pre(meta["pre"])
    writer.add_token_list(meta["tokens"])
    writer.add_token_types(meta["token_type"])
    writer.add_token_merges(meta["merges"])
    for key, fn in (("bos_token_id", writer.add_bos_token_id), ("eos_token_id", writer.add_eos_token_id),
                    ("pad_token_id", writer.add_pad_token_id)):
        if meta[key] is not None:
            fn(int(meta[key]))
    writer.add_add_bos_token(meta["add_bos_token"])
    writer.add_add_eos_token(meta["add_eos_token"])
    if meta["chat_template"]:
        writer.add_chat_template(meta["chat_template"])


def tokenizer_from_fields(fields: dict, source: str) -> Tokenizer:
    """Rebuild the tokenizer from GGUF fields (key -> Python value) as a surojax Tokenizer."""
    model = fields.get("tokenizer.ggml.model")
    if model != "gpt2":
        raise GGUFTokenizerError(f"{source}: tokenizer.ggml.model is {model!r}; only byte-level BPE ('gpt2') GGUF "
                                 "vocabularies can be loaded (use `tokenizer:` to point at a HF tokenizer folder)")
    tokens = _typed_list(fields, "tokenizer.ggml.tokens", str, source, required=True)
    types = _typed_list(fields, "tokenizer.ggml.token_type", int, source) or [NORMAL] * len(tokens)
    if len(types) != len(tokens):
        raise GGUFTokenizerError(f"{source}: tokenizer.ggml.token_type: expected {len(tokens)} types (one per token),"
                                 f" found {len(types)}")
    merge_strings = _typed_list(fields, "tokenizer.ggml.merges", str, source)
    bad = next((m for m in merge_strings if m.count(" ") != 1), None)
    if bad is not None:
        raise GGUFTokenizerError(f"{source}: tokenizer.ggml.merges: expected 'left right' pairs, found {bad!r}")
    merges = [tuple(m.split(" ", 1)) for m in merge_strings]
    pre = fields.get("tokenizer.ggml.pre", "default")
    if not isinstance(pre, str):
        raise GGUFTokenizerError(f"{source}: tokenizer.ggml.pre: expected a string, found {type(pre).__name__}")
    vocab = {t: i for i, (t, ty) in enumerate(zip(tokens, types)) if ty != UNUSED}
    try:
        bpe = models.BPE(vocab, merges, fuse_unk=False, byte_fallback=False, ignore_merges=pre == "llama-bpe")
    except Exception as e:  # tokenizers raises a bare Exception (e.g. a merge of a token not in the vocabulary)
        raise GGUFTokenizerError(f"{source}: tokenizer.ggml.tokens / merges: expected a consistent BPE vocabulary, "
                                 f"found {e}") from None
    backend = tokenizers.Tokenizer(bpe)
    if pre == "qwen2":
        backend.normalizer = normalizers.NFC()
    split = PRE_SPLIT.get(pre)
    if split:
        backend.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(tokenizers.Regex(split), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    else:
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    backend.decoder = decoders.ByteLevel()
    specials = [tokenizers.AddedToken(tokens[i], special=True, normalized=False)
                for i, ty in enumerate(types) if ty == CONTROL]
    users = [tokenizers.AddedToken(tokens[i], special=False, normalized=False)
             for i, ty in enumerate(types) if ty == USER_DEFINED]
    backend.add_special_tokens(specials)
    backend.add_tokens(users)
    config = {}
    for key in ("bos", "eos", "pad"):
        i = fields.get(f"tokenizer.ggml.{key}_token_id")
        if type(i) is int and 0 <= i < len(tokens):
            config[f"{key}_token"] = tokens[int(i)]
    bos = config.get("bos_token")
    if fields.get("tokenizer.ggml.add_bos_token") is True and bos is not None and bos in vocab:
        backend.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, vocab[bos])])
    else:
        backend.post_processor = processors.ByteLevel(trim_offsets=False)
    template = fields.get("tokenizer.chat_template")
    if template is not None and not isinstance(template, str):
        raise GGUFTokenizerError(f"{source}: tokenizer.chat_template: expected a string, found "
                                 f"{type(template).__name__}")
    return Tokenizer(backend, config, template, source=source)


def _typed_list(fields: dict, key: str, kind: type, source: str, required: bool = False) -> list:
    """fields[key] checked to be a list of `kind` (GGUFTokenizerError naming the key); [] when absent and not
    required."""
    if key not in fields:
        if required:
            raise GGUFTokenizerError(f"{source}: metadata key {key} is missing")
        return []
    v = fields[key]
    if not isinstance(v, list) or not all(type(x) is kind for x in v):
        found = type(v).__name__ if not isinstance(v, list) else \
            f"an item of type {next(type(x).__name__ for x in v if type(x) is not kind)}"
        raise GGUFTokenizerError(f"{source}: metadata key {key}: expected a list of {kind.__name__}, found {found}")
    return v


def save_tokenizer_dir(tok: Tokenizer, out_dir) -> Path:
    """Write tokenizer.json + tokenizer_config.json (special tokens, chat template) so that Tokenizer.from_dir
    and transformers read the rebuilt tokenizer back."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tok.backend.save(str(out_dir / "tokenizer.json"))
    cfg = {"tokenizer_class": "PreTrainedTokenizerFast", **tok.special_tokens}
    if isinstance(tok.chat_template, str):
        cfg["chat_template"] = tok.chat_template
    (out_dir / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2, ensure_ascii=False) + "\n")
    return out_dir
