"""Anchor for GRPO: TRL's GRPOTrainer with transformers generation (`model.generate`, TRL's default without vLLM),
PEFT LoRA, on the same shapes, prompts, reward and batch as benchmarks/campaigns/grpo_h200.py's run of ours.

    python3 trl_grpo_baseline.py --work DIR --steps 2 [--cpu]

DIR (written by grpo_h200.py): tokenizer/, prompts.jsonl; --model the random bf16 base ours loads too. TRL's own defaults are kept where the bench does not set a value (gradient checkpointing on, bf16,
sdpa attention). Time per optimizer step is split as ours is: generation (TRL's `_generate_single_turn`, the
transformers `generate` call), reference (the log-prob passes TRL makes while scoring a generation batch: the
adapter-disabled reference for beta > 0), training (the rest of the step: forward/backward of every micro-batch,
optimizer). Each phase is timed between torch.cuda.synchronize() calls. Prints RESULT {json} per step.
"""
import argparse
import json
import sys
import time
from pathlib import Path

import torch
from datasets import Dataset
from peft import LoraConfig
from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast, TrainerCallback
from trl import GRPOConfig, GRPOTrainer

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "campaigns"))  # the shared reward function
from grpo_bench_rewards import distinct_words  # noqa: E402

p = argparse.ArgumentParser()
p.add_argument("--work", required=True)
p.add_argument("--model", required=True, help="the HF folder of the random base (the one ours loads)")
p.add_argument("--steps", type=int, default=2)
p.add_argument("--batch", type=int, default=16, help="completions per micro-batch (per_device_train_batch_size)")
p.add_argument("--accum", type=int, default=32, help="gradient_accumulation_steps (= steps_per_generation)")
p.add_argument("--num-generations", type=int, default=8)
p.add_argument("--max-completion", type=int, default=512)
p.add_argument("--beta", type=float, default=0.04)
p.add_argument("--rank", type=int, default=16)
p.add_argument("--cpu", action="store_true", help="plumbing check: CPU, fp32")
a = p.parse_args()
work = Path(a.work)
cuda = not a.cpu


def sync():
    if cuda:
        torch.cuda.synchronize()


class Clock:
    """Seconds spent in generation and in the scoring passes, per optimizer step."""

    def __init__(self):
        self.generation = self.reference = 0.0
        self.scoring = False


clock = Clock()


class TimedGRPOTrainer(GRPOTrainer):
    def _generate_single_turn(self, *args, **kwargs):
        sync()
        t0 = time.perf_counter()
        out = super()._generate_single_turn(*args, **kwargs)
        sync()
        clock.generation += time.perf_counter() - t0
        return out

    def _generate_and_score_completions(self, *args, **kwargs):
        clock.scoring = True
        try:
            return super()._generate_and_score_completions(*args, **kwargs)
        finally:
            clock.scoring = False

    def _get_per_token_logps_and_entropies(self, *args, **kwargs):
        if not clock.scoring:
            return super()._get_per_token_logps_and_entropies(*args, **kwargs)
        sync()
        t0 = time.perf_counter()
        out = super()._get_per_token_logps_and_entropies(*args, **kwargs)
        sync()
        clock.reference += time.perf_counter() - t0
        return out


class StepTimer(TrainerCallback):
    def __init__(self):
        self.records = []
        self.t0 = None

    def on_step_begin(self, args, state, control, **kwargs):
        sync()
        clock.generation = clock.reference = 0.0
        self.t0 = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        sync()
        step = time.perf_counter() - self.t0
        rec = {"impl": "trl", "step": state.global_step, "step_time": step, "generation_time": clock.generation,
               "reference_time": clock.reference, "training_time": step - clock.generation - clock.reference}
        self.records.append(rec)
        print("RESULT " + json.dumps(rec), flush=True)


torch.manual_seed(0)
dtype = torch.bfloat16 if cuda else torch.float32
model = AutoModelForCausalLM.from_pretrained(a.model, attn_implementation="sdpa", dtype=dtype,
                                             device_map="cuda" if cuda else "cpu")
tokenizer = PreTrainedTokenizerFast.from_pretrained(str(work / "tokenizer"))
rows = [json.loads(line) for line in (work / "prompts.jsonl").read_text().splitlines()]
dataset = Dataset.from_list([{"prompt": r["prompt"]} for r in rows])
args = GRPOConfig(output_dir=str(work / "trl-out"), per_device_train_batch_size=a.batch,
                  gradient_accumulation_steps=a.accum, num_generations=a.num_generations,
                  max_completion_length=a.max_completion, temperature=1.0, beta=a.beta, loss_type="dapo",
                  learning_rate=1e-6, max_steps=a.steps, logging_steps=1, save_strategy="no", report_to="none",
                  seed=0, bf16=cuda, use_cpu=not cuda, shuffle_dataset=True)
timer = StepTimer()
trainer = TimedGRPOTrainer(model=model, reward_funcs=[distinct_words], args=args, train_dataset=dataset,
                           processing_class=tokenizer, callbacks=[timer],
                           peft_config=LoraConfig(r=a.rank, lora_alpha=2 * a.rank, target_modules="all-linear",
                                                  lora_dropout=0.0, task_type="CAUSAL_LM"))
trainer.train()
logs = [h for h in trainer.state.log_history if "completions/mean_length" in h]
for rec, h in zip(timer.records, logs):
    rec["completion_length"] = h.get("completions/mean_length")
    rec["reward"] = h.get("reward")
print("SUMMARY " + json.dumps({"impl": "trl", "steps": timer.records,
                               "peak_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else None,
                               "generation_batch": a.batch * a.accum}), flush=True)
