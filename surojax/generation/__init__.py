"""Generation shared by training (eval, rollouts) and serving: `loop.py` (prefill / decode with a plain KV
cache) and `sampling.py` (per-row sampling parameters, penalties, logprobs). Below both train/ and serve/;
imports only models/."""
