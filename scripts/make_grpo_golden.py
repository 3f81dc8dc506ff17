"""Golden numbers of TRL's GRPO loss for tests/losses/test_grpo_loss.py (deterministic; reference env only).

    /work/refenv/bin/python scripts/make_grpo_golden.py     # writes tests/fixtures/grpo/trl_loss.json

Runs TRL's own `GRPOTrainer._compute_loss` (trl installed in the reference env: `pip install trl`) on fixed
per-token log-probabilities, old / reference log-probabilities, advantages and a completion mask, for every
surojax loss_type (gspo = TRL's loss_type "grpo" with importance_sampling_level "sequence", TRL's recipe for the
GSPO paper), with and without the KL term. The trainer object is a stand-in holding only the attributes
`_compute_loss` reads, on one process and one micro-batch (no accumulation), and the model's forward pass is
replaced by the fixed log-probabilities, so the file records TRL's loss, its gradient with respect to the
log-probabilities, and its logged kl / clip_ratio metrics.
"""
from __future__ import annotations

import json
import types
from collections import defaultdict
from pathlib import Path

import numpy as np
import torch
import trl
from trl import GRPOTrainer

OUT = Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "grpo" / "trl_loss.json"
R, T, MAX_COMPLETION_LENGTH = 6, 7, 9
EPSILON, EPSILON_HIGH = 0.2, 0.28


def inputs(seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    logps = -np.abs(rng.normal(1.5, 1.0, (R, T)))
    old = logps + rng.normal(0.0, 0.25, (R, T))  # token ratios on both sides of the clip band
    old[0] -= 0.6  # and whole completions (gspo's ratios): row 0 above 1 + epsilon_high (advantage > 0),
    old[3] += 0.5  # row 3 below 1 - epsilon (advantage < 0)
    ref = logps + rng.normal(0.0, 0.5, (R, T))
    lengths = np.array([7, 5, 3, 1, 6, 4])
    mask = (np.arange(T)[None, :] < lengths[:, None]).astype(np.float64)
    advantages = np.array([1.2, -0.7, 0.4, -1.5, 0.9, -0.3])
    return {"logps": logps, "old_logps": old, "ref_logps": ref, "mask": mask, "advantages": advantages}


class _Accelerator:
    num_processes = 1

    @staticmethod
    def gather(x):
        return x

    @staticmethod
    def reduce(x, reduction="sum"):
        return x

    gather_for_metrics = gather


def trl_loss(data: dict, loss_type: str, beta: float) -> dict:
    level = "sequence" if loss_type == "gspo" else "token"
    logps = torch.tensor(data["logps"], dtype=torch.float64, requires_grad=True)
    mask = torch.tensor(data["mask"], dtype=torch.float64)
    fake = types.SimpleNamespace(
        top_entropy_quantile=1.0, off_policy_mask_threshold=None, importance_sampling_level=level, beta=beta,
        loss_type="grpo" if loss_type == "gspo" else loss_type, epsilon_low=EPSILON, epsilon_high=EPSILON_HIGH,
        use_vllm=False, vllm_importance_sampling_correction=False, model=types.SimpleNamespace(training=True),
        current_gradient_accumulation_steps=1, max_completion_length=MAX_COMPLETION_LENGTH,
        accelerator=_Accelerator(), _entropy_bonus_enabled=False, aux_loss_enabled=False,
        _metrics={"train": defaultdict(list)},
        args=types.SimpleNamespace(use_bias_correction_kl=False, delta=None, steps_per_generation=1),
        _get_per_token_logps_and_entropies=lambda *a, **k: (logps, torch.zeros_like(logps), None),
    )
    batch = {
        "prompt_ids": torch.zeros((R, 1), dtype=torch.long), "prompt_mask": torch.ones((R, 1), dtype=torch.long),
        "completion_ids": torch.zeros((R, T), dtype=torch.long), "completion_mask": mask,
        "advantages": torch.tensor(data["advantages"], dtype=torch.float64),
        "old_per_token_logps": torch.tensor(data["old_logps"], dtype=torch.float64),
        "ref_per_token_logps": torch.tensor(data["ref_logps"], dtype=torch.float64),
        "num_items_in_batch": mask.sum(),
    }
    loss = GRPOTrainer._compute_loss(fake, None, batch)
    loss.backward()
    metrics = {k: v[-1] for k, v in fake._metrics["train"].items()
               if k == "kl" or k.startswith("clip_ratio/") and k.endswith("_mean")}
    return {"loss_type": loss_type, "beta": beta, "loss": loss.item(), "grad_logps": logps.grad.tolist(),
            "metrics": metrics}


def main() -> None:
    data = inputs()
    cases = [trl_loss(data, lt, beta) for lt in ("grpo", "dr_grpo", "dapo", "gspo") for beta in (0.0, 0.04)]
    OUT.parent.mkdir(parents=True, exist_ok=True)
    out = {"trl_version": trl.__version__, "epsilon": EPSILON, "epsilon_high": EPSILON_HIGH,
           "max_completion_length": MAX_COMPLETION_LENGTH, "inputs": {k: v.tolist() for k, v in data.items()},
           "cases": cases}
    OUT.write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {OUT} ({len(cases)} cases, trl {trl.__version__})")


if __name__ == "__main__":
    main()
