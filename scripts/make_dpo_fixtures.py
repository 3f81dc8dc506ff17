"""Golden DPO fixtures from transformers + peft (run in the reference env, deterministic):

    /work/refenv/bin/python scripts/make_dpo_fixtures.py

On tests/fixtures/models/qwen3 with a random PEFT LoRA adapter (policy = base + adapter, reference = base with the
adapter disabled, as TRL does for a PEFT model) and three preference pairs (two standard, one conversational),
tokenized with the HF tokenizer by the rules of surojax/data/preference.py, writes tests/fixtures/dpo/:
    adapter/        the PEFT adapter (adapter_config.json + adapter_model.safetensors)
    golden.json     rows, token ids (prompt / chosen / rejected per pair), per-sequence response log-prob sums of
                    policy and reference, the DPO loss (mean over pairs) per loss type (TRL's formulas, written
                    out below in torch), and torch's gradient of the sigmoid loss w.r.t. layer 0's q_proj A and B.
"""
import json
from pathlib import Path

import torch
import torch.nn.functional as F
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM, AutoTokenizer

ROOT = Path(__file__).resolve().parents[1]
BASE = ROOT / "tests" / "fixtures" / "models" / "qwen3"
OUT = ROOT / "tests" / "fixtures" / "dpo"
BETA = 0.1
ROWS = [
    {"prompt": "What is 3 plus 4?", "chosen": "3 plus 4 is 7.", "rejected": "It is 9."},
    {"prompt": "Name a colour.", "chosen": "Blue", "rejected": "A number"},
    {"prompt": [{"role": "user", "content": "Say hello"}], "chosen": [{"role": "assistant", "content": "Hello!"}],
     "rejected": [{"role": "assistant", "content": "No."}]},
]
LOSSES = {"sigmoid": dict(loss_type="sigmoid", label_smoothing=0.0), "sigmoid_ls": dict(loss_type="sigmoid",
          label_smoothing=0.1), "hinge": dict(loss_type="hinge"), "ipo": dict(loss_type="ipo")}


def tokenize(tok, row):
    if isinstance(row["prompt"], str):
        prompt = tok(row["prompt"]).input_ids  # the tokenizer's own special tokens
        eos = [tok.eos_token_id]
        return prompt, tok(row["chosen"], add_special_tokens=False).input_ids + eos, \
            tok(row["rejected"], add_special_tokens=False).input_ids + eos
    prompt_text = tok.apply_chat_template(row["prompt"], add_generation_prompt=True, tokenize=False)
    out = [tok(prompt_text, add_special_tokens=False).input_ids]
    for key in ("chosen", "rejected"):
        full = tok.apply_chat_template(row["prompt"] + row[key], tokenize=False)
        assert full.startswith(prompt_text)
        out.append(tok(full[len(prompt_text):], add_special_tokens=False).input_ids)
    return tuple(out)


def response_logp(model, prompt, response):
    ids = torch.tensor([prompt + response])
    logits = model(input_ids=ids).logits[0, :-1].float()  # position t predicts ids[t + 1]
    lp = torch.log_softmax(logits, -1).gather(-1, ids[0, 1:, None])[:, 0]
    return lp[len(prompt) - 1:].sum()


def dpo(policy, reference, lengths, loss_type, label_smoothing=0.0):
    """TRL DPOTrainer.dpo_loss: policy / reference [P, 2] sums; ipo on per-token means."""
    if loss_type == "ipo":
        policy, reference = policy / lengths, reference / lengths
    h = (policy[:, 0] - policy[:, 1]) - (reference[:, 0] - reference[:, 1])
    if loss_type == "sigmoid":
        loss = -F.logsigmoid(BETA * h) * (1 - label_smoothing) - F.logsigmoid(-BETA * h) * label_smoothing
    elif loss_type == "hinge":
        loss = torch.relu(1 - BETA * h)
    else:
        loss = (h - 1 / (2 * BETA)) ** 2
    return loss.mean()


def main():
    torch.manual_seed(0)
    tok = AutoTokenizer.from_pretrained(BASE)
    model = AutoModelForCausalLM.from_pretrained(BASE, dtype=torch.float32)
    cfg = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"], lora_dropout=0.0,
                     init_lora_weights=False)
    model = get_peft_model(model, cfg).eval()
    for name, p in model.named_parameters():  # a modest random adapter: log-ratios of order 1
        if "lora_B" in name:
            p.data.mul_(0.3)
    model.save_pretrained(OUT / "adapter")
    (OUT / "adapter" / "README.md").unlink(missing_ok=True)  # the model card peft writes
    pairs = [tokenize(tok, r) for r in ROWS]
    policy = torch.stack([torch.stack([response_logp(model, p, c), response_logp(model, p, r)]) for p, c, r in pairs])
    with torch.no_grad(), model.disable_adapter():
        reference = torch.stack([torch.stack([response_logp(model, p, c), response_logp(model, p, r)])
                                 for p, c, r in pairs])
    lengths = torch.tensor([[len(c), len(r)] for _, c, r in pairs], dtype=torch.float32)
    losses = {name: float(dpo(policy, reference, lengths, **kw).detach()) for name, kw in LOSSES.items()}
    q = model.base_model.model.model.layers[0].self_attn.q_proj
    a, b = q.lora_A["default"].weight, q.lora_B["default"].weight  # [R, in], [out, R]
    grad_a, grad_b = torch.autograd.grad(dpo(policy, reference, lengths, "sigmoid"), [a, b])
    golden = {"beta": BETA, "rows": ROWS, "pairs": [[list(map(int, x)) for x in pair] for pair in pairs],
              "policy_logps": policy.tolist(), "reference_logps": reference.tolist(), "losses": losses,
              "grad_q_proj_layer0": {"lora_A": grad_a.tolist(), "lora_B": grad_b.tolist()}}
    (OUT / "golden.json").write_text(json.dumps(golden, indent=1) + "\n")
    print(losses)


if __name__ == "__main__":
    main()
