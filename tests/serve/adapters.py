"""Test helper: a random PEFT adapter folder and the model with it merged (what a served row with it must equal)."""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from flax import nnx

from surojax.peft.lora import apply_lora, lora_modules, merge_lora
from surojax.peft.peft_io import save_peft_adapter


def random_adapter(model, path, seed, rank=4, targets=("q_proj", "v_proj", "down_proj")):
    """Write a PEFT folder with non-zero B (a fresh adapter would be a no-op) at `path` -> the model with it merged.
    Each target in every stack that has it (a hybrid's MLP in both stacks); each layer its own values."""
    m = nnx.clone(model)
    apply_lora(m, targets=targets, rank=rank, alpha=2 * rank, rngs=nnx.Rngs(seed))
    for i, mod in enumerate(lora_modules(m).values()):  # host RNG: no random program compiled per shape
        b = 0.3 * np.random.default_rng(seed * 10 + i).standard_normal(mod.lora_b.get_value().shape)
        mod.lora_b.set_value(jnp.asarray(b, mod.lora_b.get_value().dtype))
    save_peft_adapter(m, path, None)
    return merge_lora(m)


def serve_with_adapters(engine, prompts, adapters, max_tokens):
    """Run `prompts` together, prompt i with adapter `adapters[i]` (None: the base) -> the new tokens of each."""
    rids = [engine.add_request(p, max_tokens, adapter=a) for p, a in zip(prompts, adapters)]
    outs = {r: [] for r in rids}
    while engine.has_unfinished():
        for o in engine.step():
            outs[o.request_id] += o.new_token_ids
    return [outs[r] for r in rids]


def forward_with_rows(model, tokens, rows):
    """The logits of a model with LoRA slots, row b with adapter slot rows[b] (one jitted forward)."""
    from surojax.peft.multi_lora import set_adapter_rows

    return nnx.jit(lambda m, x, r: (set_adapter_rows(m, r), m(x))[1])(model, tokens, rows)
