"""Golden fixtures for Hugging Face parity: a tiny tokenizer, chat templates and tiny random models.

Run with the reference environment (torch + transformers), never from the surojax venv:

    /work/refenv/bin/python scripts/make_fixtures.py            # writes tests/fixtures/
    /work/refenv/bin/python scripts/make_fixtures.py --only gpt_oss gpt_oss_mxfp4   # just these model folders

Everything is deterministic (fixed corpus, fixed seeds), so a re-run rewrites the same bytes as long as the
library versions recorded in tests/fixtures/README.md are the same. What is written:

    tests/fixtures/tokenizer/               byte-level BPE (~512 ids) + ChatML-style chat template, loadable by
                                            transformers.AutoTokenizer; expected_chat.json = HF's rendering
    tests/fixtures/chat_templates/          llama3_style.jinja (bos_token, raise_exception, tojson(indent=4))
    tests/fixtures/models/<name>/           save_pretrained() output (fp32 safetensors) + tokenizer files +
                                            expected.npz (eager logits of three sequences, greedy tokens;
                                            MoE folders also the load-balancing aux loss of a padded batch)
    tests/fixtures/models/gpt_oss_mxfp4/    gpt_oss's weights in the published MXFP4 + bf16 checkpoint layout
    tests/fixtures/models/config_keys.json  the config.json keys transformers wrote for each model
"""
from __future__ import annotations

import json
import random
import argparse
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
FIXTURES = ROOT / "tests" / "fixtures"
TOKENIZER_DIR = FIXTURES / "tokenizer"
TEMPLATES_DIR = FIXTURES / "chat_templates"
MODELS_DIR = FIXTURES / "models"

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>"]
BPE_VOCAB_SIZE = 507  # + 5 special tokens appended after training = 512 ids
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
# Qwen2's split regex (the GPT-4 style pattern, single digits): contractions, letters, digits, punctuation, spaces.
SPLIT_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
               r"|\s*[\r\n]+|\s+(?!\S)|\s+")

# ----------------------------------------------------------------------------------------------------------------
# Corpus
# ----------------------------------------------------------------------------------------------------------------

PARAGRAPHS = [
    "The quick brown fox jumps over the lazy dog. A small model can still learn the shape of a language.",
    "You are a helpful assistant. Answer the question as well as you can, and say so when you do not know.",
    "What is the capital of France? The capital of France is Paris, a city on the river Seine.",
    "Please write a short poem about the sea, the wind and the light of the morning.",
    "def add(a, b):\n    return a + b\n\nprint(add(2, 3))  # prints 5\n",
    "The weather today is sunny with a high of 21 degrees and a light wind from the west.",
    "To call a function, reply with a JSON object that names the function and gives its arguments.",
    "Let me think about this step by step. First, we count the apples; then we add the pears.",
    "Tokenizers split text into pieces; a byte-level tokenizer can encode any string at all.",
    "I'm sure they'll say it's fine, but we've seen what they'd do if you're not careful.",
]
SUBJECTS = ["the model", "a student", "the teacher", "my friend", "the system", "our team", "the user", "a robot"]
VERBS = ["reads", "writes", "answers", "learns", "explains", "tests", "checks", "builds", "finds", "sees"]
OBJECTS = ["the answer", "a question", "the code", "a story", "the data", "some numbers", "the weather",
           "a new word", "the function", "the tools"]
ENDINGS = [".", "!", "?", " today.", " again.", " with care.", " in the morning.", " for the test."]


def make_corpus(n_sentences: int = 3000, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    lines = list(PARAGRAPHS) * 20
    for _ in range(n_sentences):
        s = f"{rng.choice(SUBJECTS)} {rng.choice(VERBS)} {rng.choice(OBJECTS)}{rng.choice(ENDINGS)}"
        lines.append(s[0].upper() + s[1:] + (f" {rng.randint(0, 999)}" if rng.random() < 0.2 else ""))
    return lines


# ----------------------------------------------------------------------------------------------------------------
# Tokenizer
# ----------------------------------------------------------------------------------------------------------------

CHATML_TEMPLATE = """\
{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0].role == 'system' %}
        {{- messages[0].content + '\\n\\n' }}
    {%- endif %}
    {{- '# Tools\\n\\nYou may call functions. Their signatures are inside <tools></tools>:\\n<tools>' }}
    {%- for tool in tools %}
        {{- '\\n' + (tool | tojson) }}
    {%- endfor %}
    {{- '\\n</tools>\\n\\nTo call one, reply with <tool_call>{"name": ..., "arguments": ...}</tool_call>.<|im_end|>\\n' }}
{%- elif messages[0].role == 'system' %}
    {{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
{%- endif %}
{%- set ns = namespace(last_user=-1) %}
{%- for message in messages %}
    {%- if message.role == 'user' %}
        {%- set ns.last_user = loop.index0 %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- if message.role == 'system' %}
        {%- if not loop.first %}
            {{- raise_exception('A system message may only come first.') }}
        {%- endif %}
        {%- continue %}
    {%- endif %}
    {%- if message.role == 'user' %}
        {{- '<|im_start|>user\\n' + message.content + '<|im_end|>\\n' }}
    {%- elif message.role == 'assistant' %}
        {%- set content = message.content if message.content is string else '' %}
        {%- set reasoning = '' %}
        {%- if message.reasoning_content is string %}
            {%- set reasoning = message.reasoning_content %}
        {%- elif '</think>' in content %}
            {%- set reasoning = content.split('</think>')[0].split('<think>')[-1].strip('\\n') %}
            {%- set content = content.split('</think>')[-1].lstrip('\\n') %}
        {%- endif %}
        {{- '<|im_start|>assistant\\n' }}
        {%- if loop.index0 > ns.last_user and reasoning %}
            {{- '<think>\\n' + reasoning + '\\n</think>\\n\\n' }}
        {%- endif %}
        {{- content }}
        {%- for call in message.tool_calls | default([]) %}
            {%- set fn = call.function if call.function is defined else call %}
            {{- '\\n<tool_call>\\n{"name": "' + fn.name + '", "arguments": ' }}
            {{- fn.arguments if fn.arguments is string else fn.arguments | tojson }}
            {{- '}\\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == 'tool' %}
        {{- '<|im_start|>user\\n<tool_response>\\n' + message.content + '\\n</tool_response><|im_end|>\\n' }}
    {%- else %}
        {{- raise_exception('Unknown role: ' + message.role) }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\\n\\n</think>\\n\\n' }}
    {%- endif %}
{%- endif %}
"""

LLAMA3_STYLE_TEMPLATE = """\
{{- bos_token }}
{%- if messages[0].role == 'system' %}
    {%- set system_message = messages[0].content | trim %}
    {%- set loop_messages = messages[1:] %}
{%- else %}
    {%- set system_message = '' %}
    {%- set loop_messages = messages %}
{%- endif %}
{%- if date_string is not defined %}
    {%- if use_today is defined and use_today %}
        {%- set date_string = strftime_now('%d %b %Y') %}
    {%- else %}
        {%- set date_string = '26 Jul 2024' %}
    {%- endif %}
{%- endif %}
{{- '<|start_header_id|>system<|end_header_id|>\\n\\n' }}
{{- 'Today Date: ' + date_string + '\\n\\n' }}
{%- if tools is not none %}
    {{- 'You can call these functions:\\n' }}
    {%- for t in tools %}
        {{- t | tojson(indent=4) }}
        {{- '\\n\\n' }}
    {%- endfor %}
{%- endif %}
{{- system_message + '<|eot_id|>' }}
{%- for message in loop_messages %}
    {%- if message.role not in ['user', 'assistant'] %}
        {{- raise_exception('Only user and assistant roles are supported after the system message, got ' + message.role) }}
    {%- endif %}
    {%- if (message.role == 'user') != (loop.index0 % 2 == 0) %}
        {{- raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}
    {%- endif %}
    {{- '<|start_header_id|>' + message.role + '<|end_header_id|>\\n\\n' + message.content | trim + '<|eot_id|>' }}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}
{%- endif %}
"""


def build_tokenizer(out_dir: Path):
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors
    from tokenizers import trainers

    tok = Tokenizer(models.BPE(unk_token=None, fuse_unk=False, byte_fallback=False))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(SPLIT_REGEX), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(vocab_size=BPE_VOCAB_SIZE, min_frequency=2, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), special_tokens=[])
    tok.train_from_iterator(make_corpus(), trainer=trainer)
    assert tok.get_vocab_size() == BPE_VOCAB_SIZE, tok.get_vocab_size()
    # Special tokens go after the BPE ids (as in Qwen), so no code may assume they are the low ids.
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    out_dir.mkdir(parents=True, exist_ok=True)
    tok.save(str(out_dir / "tokenizer.json"))

    ids = {t: tok.token_to_id(t) for t in SPECIAL_TOKENS}
    added_tokens_decoder = {
        str(ids[t]): {"content": t, "lstrip": False, "normalized": False, "rstrip": False, "single_word": False,
                      "special": True}
        for t in SPECIAL_TOKENS
    }
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "added_tokens_decoder": added_tokens_decoder,
        "additional_special_tokens": ["<|im_start|>", "<|im_end|>", "<think>", "</think>"],
        "bos_token": "<|endoftext|>",
        # The AddedToken-dict form (older transformers save it so) next to the plain string form above.
        "eos_token": {"__type": "AddedToken", "content": "<|im_end|>", "lstrip": False, "normalized": False,
                      "rstrip": False, "single_word": False, "special": True},
        "pad_token": "<|endoftext|>",
        "unk_token": None,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 4096,
        "errors": "replace",
        "split_special_tokens": False,
        "chat_template": CHATML_TEMPLATE,
    }
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")
    special_map = {
        "additional_special_tokens": ["<|im_start|>", "<|im_end|>", "<think>", "</think>"],
        "bos_token": "<|endoftext|>", "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>",
    }
    (out_dir / "special_tokens_map.json").write_text(json.dumps(special_map, indent=2) + "\n")
    return ids


# ----------------------------------------------------------------------------------------------------------------
# Chat cases
# ----------------------------------------------------------------------------------------------------------------

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Température actuelle (°C) d'une ville — use <city> & 'country'.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "description": "The city, e.g. Zürich"},
                           "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
            "required": ["city"],
        },
    },
}

CHAT_CASES = [
    {"name": "single_turn", "messages": [{"role": "user", "content": "What is the capital of France?"}],
     "add_generation_prompt": True},
    {"name": "system_multi_turn", "add_generation_prompt": False, "messages": [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "Write a short poem."},
        {"role": "assistant", "content": "The sea is wide,\nthe wind is light."},
        {"role": "user", "content": "Thanks! Another one?"},
        {"role": "assistant", "content": "  The morning sun\nhas just begun.  "},
    ]},
    {"name": "multi_turn_generation_prompt", "add_generation_prompt": True, "messages": [
        {"role": "system", "content": "  Answer briefly.\n"},
        {"role": "user", "content": "2 + 3?"},
        {"role": "assistant", "content": "5"},
        {"role": "user", "content": "And 10 * 4?"},
    ]},
    {"name": "unicode", "add_generation_prompt": True, "messages": [
        {"role": "user", "content": "Grüße aus Zürich! 東京は晴れ 🌞 — naïve café, Ελληνικά, emoji 👩‍💻\ttab"},
    ]},
    {"name": "tools", "add_generation_prompt": True, "tools": [WEATHER_TOOL], "messages": [
        {"role": "system", "content": "You can look up the weather."},
        {"role": "user", "content": "How warm is it in Zürich?"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Zürich"}}}]},
        {"role": "tool", "content": "{\"temperature\": 21}"},
    ]},
    {"name": "tools_no_system", "add_generation_prompt": True, "tools": [WEATHER_TOOL],
     "kwargs": {"date_string": "1 Jan 2025"}, "messages": [{"role": "user", "content": "Weather in Paris & Oslo?"}]},
    {"name": "roles_not_alternating", "add_generation_prompt": True, "messages": [
        {"role": "user", "content": "First question."}, {"role": "user", "content": "Second question."}]},
    {"name": "thinking", "add_generation_prompt": False, "messages": [
        {"role": "user", "content": "Is 7 prime?"},
        {"role": "assistant", "content": "<think>\nIt has no divisors but 1 and 7.\n</think>\n\nYes, 7 is prime."},
        {"role": "user", "content": "Is 9 prime?"},
        {"role": "assistant", "content": "<think>\n9 = 3 * 3.\n</think>\n\nNo, 9 = 3 × 3."},
    ]},
    {"name": "no_thinking_prompt", "add_generation_prompt": True, "kwargs": {"enable_thinking": False},
     "messages": [{"role": "user", "content": "Say hi."}]},
]


def chat_expectations(tok_dir: Path) -> dict:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tok_dir)
    llama_template = (TEMPLATES_DIR / "llama3_style.jinja").read_text()
    templates = {"chatml": None, "llama3_style": llama_template}
    cases = []
    for case in CHAT_CASES:
        expected = {}
        for name, template in templates.items():
            kw = dict(add_generation_prompt=case["add_generation_prompt"], tools=case.get("tools"),
                      chat_template=template, **case.get("kwargs", {}))
            try:
                text = tok.apply_chat_template(case["messages"], tokenize=False, **kw)
            except Exception as e:  # noqa: BLE001 - the template's own raise_exception is a recorded outcome
                expected[name] = {"error": type(e).__name__, "message": str(e)}
                continue
            # transformers 5 returns a BatchEncoding for tokenize=True unless return_dict=False.
            ids = tok.apply_chat_template(case["messages"], tokenize=True, return_dict=False, **kw)
            assert ids == tok(text, add_special_tokens=False)["input_ids"], case["name"]
            expected[name] = {"text": text, "ids": list(ids)}
        cases.append({**{k: v for k, v in case.items()}, "expected": expected})
    return {
        "about": "tokenizer.apply_chat_template(messages, tokenize=..., add_generation_prompt=..., tools=..., "
                 "chat_template=T, **kwargs) from transformers; T = the tokenizer's own template for 'chatml', "
                 "chat_templates/llama3_style.jinja for 'llama3_style'. 'error' = the template raised.",
        "templates": {"chatml": "tokenizer/tokenizer_config.json:chat_template",
                      "llama3_style": "chat_templates/llama3_style.jinja"},
        "special_token_ids": {t: tok.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS},
        "bos_token_id": tok.bos_token_id, "eos_token_id": tok.eos_token_id, "pad_token_id": tok.pad_token_id,
        "vocab_size": len(tok),
        "encode_samples": [{"text": s, "ids": tok(s, add_special_tokens=False)["input_ids"]} for s in ENCODE_SAMPLES],
        "cases": cases,
    }


ENCODE_SAMPLES = [
    "Hello world!", "  leading spaces and trailing  ", "line one\nline two\r\n\n", "I'm sure they'll say it's OK.",
    "x = 12345 + 678", "Ünïcödé: 東京 🌞 e\u0301", "<|im_start|>user\nhi<|im_end|>", "<think>hmm</think>",
]

# ----------------------------------------------------------------------------------------------------------------
# Models
# ----------------------------------------------------------------------------------------------------------------

COMMON = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
              intermediate_size=128, max_position_embeddings=256, initializer_range=0.2, rms_norm_eps=1e-6,
              rope_theta=10000.0, hidden_act="silu")
MODEL_SPECS = {
    "llama": ("LlamaConfig", dict(tie_word_embeddings=False, rope_scaling={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 32})),
    "llama_tied": ("LlamaConfig", dict(tie_word_embeddings=True)),
    "qwen2": ("Qwen2Config", dict(tie_word_embeddings=False)),
    "qwen3": ("Qwen3Config", dict(tie_word_embeddings=False)),
    "mistral": ("MistralConfig", dict(tie_word_embeddings=False, sliding_window=6)),
}


@dataclass(frozen=True)
class MoeSpec:
    """A mixture-of-experts fixture: transformers config class, its keys (over COMMON), and the weight seed."""
    cls_name: str
    config: dict
    seed: int  # chosen so that the greedy and router top-k margins hold (see moe_expectations)


YARN = {"rope_type": "yarn", "factor": 16.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
        "original_max_position_embeddings": 16}  # the published gpt-oss keys; 16 x 16 = 256 max positions
QWEN3_MOE = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, intermediate_size=96,
                 tie_word_embeddings=False)
MOE_SPECS = {
    "qwen3_moe": MoeSpec("Qwen3MoeConfig", dict(QWEN3_MOE, norm_topk_prob=True), seed=1),
    "qwen3_moe_dense_mix": MoeSpec("Qwen3MoeConfig", dict(QWEN3_MOE, num_hidden_layers=3, mlp_only_layers=[1],
                                                          norm_topk_prob=False), seed=2),
    # a shared expert (width 48) and its sigmoid gate beside the routed experts; q/k/v biases (qkv_bias)
    "qwen2_moe": MoeSpec("Qwen2MoeConfig", dict(QWEN3_MOE, shared_expert_intermediate_size=48, norm_topk_prob=False),
                         seed=5),
    "mixtral": MoeSpec("MixtralConfig", dict(num_local_experts=8, num_experts_per_tok=2, intermediate_size=32,
                                             sliding_window=6, tie_word_embeddings=False), seed=3),
    "gpt_oss": MoeSpec("GptOssConfig", dict(
        num_local_experts=8, num_experts_per_tok=2, intermediate_size=32, num_hidden_layers=4, sliding_window=4,
        layer_types=["sliding_attention", "full_attention"] * 2, rope_scaling=YARN, router_aux_loss_coef=0.9,
        tie_word_embeddings=False), seed=14),
}
# name -> the MOE_SPECS folder whose weights it stores with MXFP4 experts, as openai/gpt-oss-* publish them.
MXFP4_SPECS = {"gpt_oss_mxfp4": "gpt_oss"}
# 8 fp32 experts take 0.2 MB a layer: gpt_oss (4 layers) and the 3-layer mix do not fit in 1 MB.
MAX_FOLDER_BYTES = {"gpt_oss": 1_600_000, "qwen3_moe_dense_mix": 1_100_000}
SEQ_LENGTHS = (5, 9, 12)
AUX_LEN, AUX_PADS = 12, 4  # aux-loss batch: [2, 12], second row right-padded with 4 pads
GREEDY_PROMPT_LEN = 7
GREEDY_NEW_TOKENS = 32


def fixed_sequences(vocab_size: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(1234)
    out = {f"seq{i}": rng.integers(0, vocab_size, size=n, dtype=np.int64) for i, n in enumerate(SEQ_LENGTHS)}
    out["greedy_prompt"] = rng.integers(0, vocab_size, size=GREEDY_PROMPT_LEN, dtype=np.int64)
    return out


def randomize_(model, seed: int):
    """Norm weights and biases random (transformers initialises them to ones / zeros)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.3 * torch.randn(p.shape, generator=g))
            elif name.endswith(".bias"):
                p.copy_(0.2 * torch.randn(p.shape, generator=g))


def experts_kwargs(name: str) -> dict:
    """MoE models run transformers' eager experts loop (the modeling code as written), not torch._grouped_mm."""
    return {"experts_implementation": "eager"} if name in MOE_SPECS or name in MXFP4_SPECS else {}


def build_model(name: str, cls_name: str, extra: dict, ids: dict, vocab_size: int) -> dict:
    """Make, save and reload one tiny random model; write its expected.npz. Returns the config.json it wrote."""
    import torch
    import transformers
    from transformers import AutoModelForCausalLM

    torch.manual_seed(MOE_SPECS[name].seed if name in MOE_SPECS else 0)
    cfg = getattr(transformers, cls_name)(**{**COMMON, **extra}, vocab_size=vocab_size, torch_dtype="float32",
                                          bos_token_id=ids["<|endoftext|>"], eos_token_id=ids["<|im_end|>"],
                                          pad_token_id=ids["<|endoftext|>"])
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="eager", dtype=torch.float32,
                                             **experts_kwargs(name))
    randomize_(model, seed=sum(map(ord, name)))
    if name in MOE_SPECS:
        randomize_moe_(model, seed=MOE_SPECS[name].seed)
    if name == "qwen2":
        assert all(model.model.layers[0].self_attn.q_proj.bias.abs() > 0)
    model.eval()

    out_dir = MODELS_DIR / name
    if out_dir.exists():
        shutil.rmtree(out_dir)
    model.save_pretrained(out_dir, safe_serialization=True)
    for f in TOKENIZER_FILES:
        shutil.copy(TOKENIZER_DIR / f, out_dir / f)
    write_expected(name, out_dir, ids, vocab_size)
    return json.loads((out_dir / "config.json").read_text())


def write_expected(name: str, out_dir: Path, ids: dict, vocab_size: int) -> None:
    """expected.npz from the model transformers loads back from `out_dir` (exactly what the fixture holds)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(out_dir, attn_implementation="eager", dtype=torch.float32,
                                                 **experts_kwargs(name)).eval()
    if name in MXFP4_SPECS:
        # transformers 5.17 on CPU dequantises the MXFP4 experts to bf16 and leaves them bf16 inside the fp32
        # model (its forward then fails on the dtype mismatch); bf16 -> fp32 is exact, so cast.
        model = model.float()
    seqs = fixed_sequences(vocab_size)
    arrays = {}
    with torch.no_grad():
        for i in range(len(SEQ_LENGTHS)):
            x = torch.tensor(seqs[f"seq{i}"])[None]
            arrays[f"tokens{i}"] = seqs[f"seq{i}"]
            arrays[f"logits{i}"] = model(x).logits[0].float().numpy()
        prompt = torch.tensor(seqs["greedy_prompt"])[None]
        # eos_token_id=None (and no min_new_tokens, which would mask eos logits) so exactly 32 plain argmax tokens.
        gen = model.generate(prompt, attention_mask=torch.ones_like(prompt), do_sample=False,
                             max_new_tokens=GREEDY_NEW_TOKENS, eos_token_id=None, pad_token_id=ids["<|endoftext|>"],
                             temperature=None, top_p=None, top_k=None)
        greedy = gen[0, prompt.shape[1]:].numpy()
        assert greedy.shape == (GREEDY_NEW_TOKENS,), greedy.shape
        # The same tokens by full re-computation and argmax, without the KV cache: generate() added nothing.
        cur, margins = prompt, []
        for _ in range(GREEDY_NEW_TOKENS):
            last = model(cur).logits[0, -1]
            top2 = last.topk(2).values
            margins.append(float(top2[0] - top2[1]))  # a tiny top-1/top-2 gap would make the parity test brittle
            cur = torch.cat([cur, last.argmax().view(1, 1)], dim=1)
        assert np.array_equal(cur[0, prompt.shape[1]:].numpy(), greedy), (name, cur, greedy)
        assert min(margins) > 1e-3, (name, min(margins))
        if name == "mistral":
            check_window_applies(model, torch.tensor(seqs["seq2"])[None], arrays["logits2"])
        if name in MOE_SPECS or name in MXFP4_SPECS:
            arrays.update(moe_expectations(name, model, [torch.tensor(seqs[f"seq{i}"])[None]
                                                         for i in range(len(SEQ_LENGTHS))] + [cur], vocab_size))
    arrays["greedy_prompt"] = seqs["greedy_prompt"]
    arrays["greedy_tokens"] = greedy.astype(np.int64)
    np.savez(out_dir / "expected.npz", **arrays)

    size = sum(f.stat().st_size for f in out_dir.iterdir())
    assert size < MAX_FOLDER_BYTES.get(name, 1_000_000), (name, size)
    probs = torch.softmax(torch.tensor(arrays["logits2"]), -1)
    print(f"{name}: {size / 1e3:.0f} kB, max prob mean {probs.max(-1).values.mean():.3f}, "
          f"logit std {arrays['logits2'].std():.2f}, greedy margin >= {min(margins):.4f}", file=sys.stderr)


# ----------------------------------------------------------------------------------------------------------------
# Mixture-of-experts models
# ----------------------------------------------------------------------------------------------------------------

def randomize_moe_(model, seed: int):
    """What randomize_ does not reach: gpt-oss's attention sinks and expert biases (its router bias ends in .bias),
    and gpt-oss expert weights large enough (gate_up 2x, down 0.5x the init) that the SwiGLU clamp at 7 bites."""
    import torch

    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("experts.gate_up_proj") and model.config.model_type == "gpt_oss":
                p.mul_(2.0)
            elif name.endswith("experts.down_proj") and model.config.model_type == "gpt_oss":
                p.mul_(0.5)
            elif name.endswith("self_attn.sinks"):
                p.copy_(0.5 * torch.randn(p.shape, generator=g))
            elif name.endswith(("experts.gate_up_proj_bias", "experts.down_proj_bias")):
                p.copy_(0.2 * torch.randn(p.shape, generator=g))


def aux_batch(vocab_size: int, pad_id: int) -> tuple[np.ndarray, np.ndarray]:
    """[2, 12] tokens and mask for the load-balancing loss; row 1 is right-padded with AUX_PADS pad tokens."""
    rng = np.random.default_rng(4321)
    tokens = rng.integers(0, vocab_size, size=(2, AUX_LEN), dtype=np.int64)
    mask = np.ones((2, AUX_LEN), dtype=np.int64)
    tokens[1, AUX_LEN - AUX_PADS:] = pad_id
    mask[1, AUX_LEN - AUX_PADS:] = 0
    return tokens, mask


def router_margin(router_logits: tuple, top_k: int) -> float:
    """Smallest gap between the k-th and (k+1)-th router logit over tokens and layers.

    Softmax is monotonic, so this is the margin of every family's top-k choice; a near-tie would make a parity test
    flip an expert on float noise.
    """
    gaps = []
    for layer in router_logits:  # each [B*T, E]
        top = layer.float().topk(top_k + 1, dim=-1).values
        gaps.append(float((top[:, top_k - 1] - top[:, top_k]).min()))
    return min(gaps)


def moe_expectations(name: str, model, margin_inputs: list, vocab_size: int) -> dict[str, np.ndarray]:
    """HF's load-balancing aux loss on a padded batch, the logits of that batch, and router-margin checks."""
    import torch

    cfg = model.config
    top_k = cfg.num_experts_per_tok
    pad_id = cfg.pad_token_id
    tokens, mask = aux_batch(vocab_size, pad_id)
    clamp = watch_clamp(model) if cfg.model_type == "gpt_oss" else None
    if cfg.model_type == "gpt_oss":
        check_yarn_applies(model)
    if cfg.model_type == "qwen3_moe":
        dense = [i for i, layer in enumerate(model.model.layers) if not hasattr(layer.mlp, "experts")]
        assert dense == cfg.mlp_only_layers, (name, dense)
    if cfg.model_type == "qwen2_moe":
        check_shared_expert_gate(model, margin_inputs[-1])
    with torch.no_grad():
        margins = [router_margin(model(x, output_router_logits=True).router_logits, top_k) for x in margin_inputs]
        out = model(torch.tensor(tokens), attention_mask=torch.tensor(mask), output_router_logits=True)
    margins.append(router_margin(out.router_logits, top_k))
    assert min(margins) > 1e-3, (name, "router top-k margin", min(margins))
    assert out.aux_loss is not None and torch.isfinite(out.aux_loss), (name, out.aux_loss)
    want = switch_aux_loss([r.float().numpy() for r in out.router_logits], mask, top_k)
    assert abs(want - float(out.aux_loss)) < 1e-5 * want, (name, want, float(out.aux_loss))  # README's formula
    assert torch.isfinite(out.logits).all(), name
    if clamp is not None:
        # the clamped SwiGLU is really exercised: some gate pre-activations pass +limit, some up ones pass +-limit
        assert clamp["gate"] > 0 and clamp["up"] > 0, (name, clamp)
        print(f"{name}: clamped gate / up values {clamp}", file=sys.stderr)
    print(f"{name}: router margin >= {min(margins):.4f}, aux loss {float(out.aux_loss):.5f}", file=sys.stderr)
    return {"aux_tokens": tokens, "aux_mask": mask, "aux_loss": np.asarray(out.aux_loss.item(), dtype=np.float32),
            "aux_coef": np.asarray(cfg.router_aux_loss_coef, dtype=np.float32),
            "aux_logits": out.logits.float().numpy()}


def check_shared_expert_gate(model, x) -> None:
    """qwen2_moe: the shared expert's sigmoid gate is mostly neither shut nor wide open on the fixture inputs (it is
    really tested), and every layer's q/k/v biases are non-zero."""
    import torch

    gates = []
    hooks = [layer.mlp.shared_expert_gate.register_forward_hook(lambda m, i, o: gates.append(torch.sigmoid(o)))
             for layer in model.model.layers]
    with torch.no_grad():
        model(x)
    for h in hooks:
        h.remove()
    g = torch.cat([t.reshape(-1) for t in gates])
    middle = float(((g > 0.1) & (g < 0.9)).float().mean())  # neither saturated nor constant
    assert middle > 0.5 and float(g.std()) > 0.05, (middle, g.std())
    assert all(bool(layer.self_attn.q_proj.bias.abs().min() > 0) for layer in model.model.layers)
    print(f"qwen2_moe: shared-expert gate in [{float(g.min()):.3f}, {float(g.max()):.3f}], {middle:.0%} in "
          "(0.1, 0.9)", file=sys.stderr)


def switch_aux_loss(router_logits: list[np.ndarray], mask: np.ndarray, top_k: int) -> float:
    """The load-balancing loss as tests/fixtures/README.md states it, in numpy: router_logits [L][B*T, E], mask [B, T].

    p = softmax(logits); f_e = top-k hits of e, P_e = sum of p_e, both over unmasked tokens of every sparse layer,
    divided by (layers x unmasked tokens); loss = E * sum_e f_e P_e (not yet times router_aux_loss_coef).
    """
    m = mask.reshape(-1).astype(np.float64)
    hits, probs = 0.0, 0.0
    for logits in router_logits:
        z = logits.astype(np.float64)
        p = np.exp(z - z.max(-1, keepdims=True))
        p /= p.sum(-1, keepdims=True)
        top = np.argsort(-p, axis=-1, kind="stable")[:, :top_k]
        onehot = np.zeros_like(p)
        np.put_along_axis(onehot, top, 1.0, axis=-1)
        hits = hits + (onehot * m[:, None]).sum(0)
        probs = probs + (p * m[:, None]).sum(0)
    rows = len(router_logits) * m.sum()
    return float(p.shape[-1] * np.sum((hits / rows) * (probs / rows)))


def check_yarn_applies(model) -> None:
    """YaRN really changes the rotary frequencies at these sizes (and scales cos/sin by 0.1 ln(factor) + 1)."""
    import math

    import torch

    rope = model.config.rope_parameters
    emb = model.model.rotary_emb
    dim = model.config.head_dim
    plain = 1.0 / (rope["rope_theta"] ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))
    assert (emb.inv_freq / plain).min() < 0.5, emb.inv_freq / plain  # interpolated dims: frequency / factor
    assert abs(emb.attention_scaling - (0.1 * math.log(rope["factor"]) + 1.0)) < 1e-6, emb.attention_scaling


def watch_clamp(model) -> dict[str, int]:
    """Counts (in place, as the model runs) the gpt-oss gate / up pre-activations that the clamp changes."""
    counts = {"gate": 0, "up": 0}
    for layer in model.model.layers:
        experts = layer.mlp.experts
        apply_gate = experts._apply_gate  # bound method of the instance: the counter wraps only this module

        def counting(gate_up, apply_gate=apply_gate, limit=experts.limit):
            counts["gate"] += int((gate_up[..., ::2] > limit).sum())
            counts["up"] += int((gate_up[..., 1::2].abs() > limit).sum())
            return apply_gate(gate_up)

        experts._apply_gate = counting
    return counts


def layer_tensors(folder: Path, layers: tuple[int, ...]) -> dict[str, list]:
    """{name: [dtype, shape]} of the given layers' tensors in folder/model.safetensors, as written."""
    from safetensors import safe_open

    out = {}
    with safe_open(folder / "model.safetensors", framework="pt") as f:
        for key in sorted(f.keys()):
            if any(key.startswith(f"model.layers.{i}.") for i in layers):
                sl = f.get_slice(key)
                out[key] = [sl.get_dtype(), list(sl.get_shape())]
    return out


# ----------------------------------------------------------------------------------------------------------------
# MXFP4 (OCP microscaling FP4, as openai/gpt-oss-* store their expert weights)
# ----------------------------------------------------------------------------------------------------------------

FP4_MAGNITUDES = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], dtype=np.float32)  # e2m1 codes 0..7; bit 3 = sign
MXFP4_BLOCK = 32


def mxfp4_quantize(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """w [..., K] float32 -> (blocks [..., K/32, 16] uint8, scales [..., K/32] uint8).

    Each 32-value block shares the scale 2**(scales - 127), the smallest power of two that brings the block's max |w|
    to <= 6 (no clipping); values round to the nearest e2m1 magnitude. Byte j of a block holds value 2j in its low
    nibble and value 2j+1 in its high nibble.
    """
    *lead, K = w.shape
    x = w.reshape(*lead, K // MXFP4_BLOCK, MXFP4_BLOCK).astype(np.float32)
    amax = np.abs(x).max(-1)
    exp = np.where(amax > 0, np.ceil(np.log2(np.maximum(amax, 1e-30) / 6.0)), -127).clip(-127, 127).astype(np.int32)
    y = x / np.exp2(exp)[..., None].astype(np.float32)
    codes = np.abs(np.abs(y)[..., None] - FP4_MAGNITUDES).argmin(-1).astype(np.uint8)
    codes |= np.where(y < 0, 8, 0).astype(np.uint8)
    blocks = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return np.ascontiguousarray(blocks, dtype=np.uint8), np.ascontiguousarray(exp + 127, dtype=np.uint8)


def mxfp4_dequantize(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """(blocks [..., G, 16] uint8, scales [..., G] uint8) -> [..., G*32] float32; the inverse layout of the above."""
    lut = np.concatenate([FP4_MAGNITUDES, -FP4_MAGNITUDES])
    codes = np.stack([blocks & 0x0F, blocks >> 4], axis=-1).reshape(*blocks.shape[:-1], 2 * blocks.shape[-1])
    vals = lut[codes] * np.exp2(scales.astype(np.float32) - 127.0)[..., None]
    return vals.reshape(*blocks.shape[:-2], -1).astype(np.float32)


def published_gpt_oss_config(cfg: dict) -> dict:
    """config.json in the spelling of openai/gpt-oss-20b/120b (transformers 4.55): rope_scaling + rope_theta,
    experts_per_token, initial_context_length, swiglu_limit, quantization_config; from our saved config dict."""
    rope = cfg["rope_parameters"]
    return {
        "architectures": ["GptOssForCausalLM"], "attention_bias": True, "attention_dropout": 0.0,
        "eos_token_id": cfg["eos_token_id"], "experts_per_token": cfg["num_experts_per_tok"],
        "head_dim": cfg["head_dim"], "hidden_act": "silu", "hidden_size": cfg["hidden_size"],
        "initial_context_length": rope["original_max_position_embeddings"],
        "initializer_range": cfg["initializer_range"], "intermediate_size": cfg["intermediate_size"],
        "layer_types": cfg["layer_types"], "max_position_embeddings": cfg["max_position_embeddings"],
        "model_type": "gpt_oss", "num_attention_heads": cfg["num_attention_heads"],
        "num_experts_per_tok": cfg["num_experts_per_tok"], "num_hidden_layers": cfg["num_hidden_layers"],
        "num_key_value_heads": cfg["num_key_value_heads"], "num_local_experts": cfg["num_local_experts"],
        "output_router_logits": False, "pad_token_id": cfg["pad_token_id"],
        "quantization_config": {"modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                                                           "model.embed_tokens", "lm_head"],
                                "quant_method": "mxfp4"},
        "rms_norm_eps": cfg["rms_norm_eps"],
        "rope_scaling": {k: rope[k] for k in ("beta_fast", "beta_slow", "factor", "original_max_position_embeddings",
                                              "rope_type", "truncate")},
        "rope_theta": rope["rope_theta"], "router_aux_loss_coef": cfg["router_aux_loss_coef"],
        "sliding_window": cfg["sliding_window"], "swiglu_limit": 7.0, "tie_word_embeddings": False,
        "transformers_version": "4.55.0.dev0", "use_cache": True, "vocab_size": cfg["vocab_size"],
    }


def build_mxfp4_model(name: str, src_name: str, ids: dict, vocab_size: int) -> dict:
    """`src_name`'s weights as published: experts MXFP4 (*_blocks / *_scales uint8), every other tensor bf16.

    transformers stores gate_up_proj [E, D, 2I] (gate/up interleaved on the last axis) and down_proj [E, I, D];
    the checkpoint stores their transposes [E, 2I, D] / [E, D, I] in 32-wide blocks along the input axis.
    """
    import torch
    from safetensors.torch import load_file, save_file

    src = MODELS_DIR / src_name
    state = load_file(src / "model.safetensors")
    tensors, dequantized = {}, {}
    for key, t in state.items():
        if key.endswith(("mlp.experts.gate_up_proj", "mlp.experts.down_proj")):
            blocks, scales = mxfp4_quantize(np.ascontiguousarray(t.transpose(1, 2).numpy()))
            tensors[key + "_blocks"], tensors[key + "_scales"] = torch.from_numpy(blocks), torch.from_numpy(scales)
            dequantized[key] = mxfp4_dequantize(blocks, scales).transpose(0, 2, 1)
        else:
            tensors[key] = t.to(torch.bfloat16).contiguous()
    out_dir = MODELS_DIR / name
    if out_dir.exists():
        shutil.rmtree(out_dir)
    out_dir.mkdir(parents=True)
    save_file(tensors, out_dir / "model.safetensors", metadata={"format": "pt"})
    config = published_gpt_oss_config(json.loads((src / "config.json").read_text()))
    (out_dir / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    for f in ("generation_config.json", *TOKENIZER_FILES):
        shutil.copy(src / f, out_dir / f)
    check_mxfp4_load(out_dir, dequantized, state)
    write_expected(name, out_dir, ids, vocab_size)
    return config


def check_mxfp4_load(out_dir: Path, dequantized: dict, state: dict) -> None:
    """transformers loads the folder (on CPU it dequantises the experts) into exactly our numpy dequantisation."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(out_dir, attn_implementation="eager", dtype=torch.float32)
    params = dict(model.named_parameters())
    for key, want in dequantized.items():
        got = params[key].detach().float().numpy()
        assert got.shape == want.shape and np.array_equal(got, want), key
        err = np.abs(want - state[key].numpy()).max() / np.abs(state[key].numpy()).max()
        assert 0 < err < 0.2, (key, err)  # a real, lossy quantisation, not a broken one
    bf16 = params["model.layers.0.self_attn.sinks"].detach()
    assert torch.equal(bf16, state["model.layers.0.self_attn.sinks"].to(torch.bfloat16).float())


def check_window_applies(model, x, windowed_logits: np.ndarray):
    """The eager forward really uses the window: without it, positions >= W change and positions < W do not."""
    import torch

    W = model.config.sliding_window
    model.config.sliding_window = None
    try:
        with torch.no_grad():
            full = model(x).logits[0].numpy()
    finally:
        model.config.sliding_window = W
    assert np.allclose(full[:W], windowed_logits[:W], atol=1e-6)
    assert not np.allclose(full[W:], windowed_logits[W:], atol=1e-3)


def check_sliding_window() -> dict:
    """What window rule transformers' eager attention applies for mistral: returns the mask it builds."""
    import torch
    from transformers import MistralConfig
    from transformers.masking_utils import create_sliding_window_causal_mask

    cfg = MistralConfig(**COMMON, vocab_size=16, sliding_window=3)
    cfg._attn_implementation = "eager"
    T = 6
    emb = torch.zeros(1, T, 64)
    mask = create_sliding_window_causal_mask(config=cfg, inputs_embeds=emb, attention_mask=torch.ones(1, T),
                                             past_key_values=None, position_ids=torch.arange(T)[None])
    allowed = (mask[0, 0] == 0).int().numpy()  # additive float mask: 0 = attend, -inf/min = masked
    q, k = np.meshgrid(np.arange(T), np.arange(T), indexing="ij")
    assert np.array_equal(allowed, ((k <= q) & (q - k < 3)).astype(int)), allowed
    return {"sliding_window": 3, "allowed[q, k]": allowed.tolist(), "rule": "0 <= q - k < W (W keys incl. self)"}


ALL_MODELS = (*MODEL_SPECS, *MOE_SPECS, *MXFP4_SPECS)


def main():
    import tokenizers
    import torch
    import transformers

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", nargs="+", choices=ALL_MODELS, metavar="NAME",
                        help="write only these model folders (the tokenizer and chat files stay as they are); "
                             f"one of {', '.join(ALL_MODELS)}")
    args = parser.parse_args()

    if args.only:
        expected = json.loads((TOKENIZER_DIR / "expected_chat.json").read_text())
        ids = expected["special_token_ids"]
        names = [n for n in ALL_MODELS if n in args.only]
        previous = json.loads((MODELS_DIR / "config_keys.json").read_text())
    else:
        TEMPLATES_DIR.mkdir(parents=True, exist_ok=True)
        (TEMPLATES_DIR / "llama3_style.jinja").write_text(LLAMA3_STYLE_TEMPLATE)
        ids = build_tokenizer(TOKENIZER_DIR)
        expected = chat_expectations(TOKENIZER_DIR)
        (TOKENIZER_DIR / "expected_chat.json").write_text(json.dumps(expected, indent=1, ensure_ascii=False) + "\n")
        names = list(ALL_MODELS)
        previous = {"configs": {}, "moe_layer_tensors": {}}
    vocab_size = expected["vocab_size"]

    MODELS_DIR.mkdir(parents=True, exist_ok=True)
    configs, tensors = dict(previous["configs"]), dict(previous.get("moe_layer_tensors", {}))
    for name in names:
        if name in MODEL_SPECS:
            configs[name] = build_model(name, *MODEL_SPECS[name], ids, vocab_size)
        elif name in MOE_SPECS:
            configs[name] = build_model(name, MOE_SPECS[name].cls_name, MOE_SPECS[name].config, ids, vocab_size)
        else:
            configs[name] = build_mxfp4_model(name, MXFP4_SPECS[name], ids, vocab_size)
        if name not in MODEL_SPECS:
            tensors[name] = layer_tensors(MODELS_DIR / name, (0, 1) if name == "qwen3_moe_dense_mix" else (0,))
    window = check_sliding_window()
    order = [n for n in ALL_MODELS if n in configs]
    (MODELS_DIR / "config_keys.json").write_text(json.dumps(
        {"transformers": transformers.__version__, "configs": {n: configs[n] for n in order},
         "sliding_window_mask": window, "moe_layer_tensors": {n: tensors[n] for n in order if n in tensors}},
        indent=1) + "\n")
    print(json.dumps({"transformers": transformers.__version__, "torch": torch.__version__,
                      "tokenizers": tokenizers.__version__}), file=sys.stderr)


if __name__ == "__main__":
    main()
