"""benchmarks/speculation.py's workloads give prompt lookup what they claim: `repeat` (a passage, an edited copy,
then the passage's first tokens again) makes n-gram lookup propose the passage's next tokens, `code` recurs in
3-grams, `chat` has none to find."""
import argparse

import numpy as np

from benchmarks.speculation import chat_prompt, code_prompt, repeat_prompt
from surojax.serve.speculative import ngram_propose

A = argparse.Namespace(vocab=151936, prompt_len=512, passage_len=160)


def test_workloads_feed_prompt_lookup():
    rng = np.random.default_rng(0)
    rep = repeat_prompt(rng, A)
    passage = rep[8:8 + A.passage_len]
    assert rep[-8:] == passage[:8] and len(rep) <= A.prompt_len
    assert ngram_propose(rep, 4) == passage[8:12]  # what a model that copies writes next
    code = code_prompt(rng, A)
    assert len(code) == A.prompt_len and len(ngram_propose(code, 4)) == 4
    chat = chat_prompt(rng, A)
    assert len(chat) == A.prompt_len and ngram_propose(chat, 4, n_min=2) == []
