"""The reward of the GRPO benchmark, shared by ours (`reward_functions: [grpo_bench_rewards:distinct_words]`) and the TRL
anchor: TRL's signature f(prompts, completions, **columns) -> list[float]. Cheap and learnable; the bench measures
time, not what is learnt."""


def distinct_words(prompts, completions, **columns):
    """Share of distinct words among a completion's words (0 for an empty completion)."""
    out = []
    for c in completions:
        words = c.split()
        out.append(len(set(words)) / len(words) if words else 0.0)
    return out
