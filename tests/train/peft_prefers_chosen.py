"""Run in the reference env by test_dpo_training.py: load BASE + the DPO adapter with peft and print the share of
pairs whose chosen answer gets a higher DPO reward (policy minus base log-prob ratio) than the rejected one.

    python peft_prefers_chosen.py BASE ADAPTER PAIRS.jsonl
"""
import json
import sys

import torch
from peft import PeftModel
from transformers import AutoModelForCausalLM, AutoTokenizer


def logp(model, prompt, response):
    ids = torch.tensor([prompt + response])
    lp = torch.log_softmax(model(input_ids=ids).logits[0, :-1].float(), -1).gather(-1, ids[0, 1:, None])[:, 0]
    return float(lp[len(prompt) - 1:].sum())


def tokenize(tok, row):
    if isinstance(row["prompt"], str):
        eos = [tok.eos_token_id]
        return (tok(row["prompt"]).input_ids, tok(row["chosen"], add_special_tokens=False).input_ids + eos,
                tok(row["rejected"], add_special_tokens=False).input_ids + eos)
    text = tok.apply_chat_template(row["prompt"], add_generation_prompt=True, tokenize=False)
    out = [tok(text, add_special_tokens=False).input_ids]
    for key in ("chosen", "rejected"):
        full = tok.apply_chat_template(row["prompt"] + row[key], tokenize=False)
        out.append(tok(full[len(text):], add_special_tokens=False).input_ids)
    return out


def main(base, adapter, pairs):
    tok = AutoTokenizer.from_pretrained(base)
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32), adapter).eval()
    wins = []
    with torch.no_grad():
        for row in map(json.loads, open(pairs)):
            p, c, r = tokenize(tok, row)
            pol = logp(model, p, c) - logp(model, p, r)
            with model.disable_adapter():
                ref = logp(model, p, c) - logp(model, p, r)
            wins.append(pol > ref)
    print(sum(wins) / len(wins))


if __name__ == "__main__":
    main(*sys.argv[1:])
