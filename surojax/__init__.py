"""surojax: pretrain, fine-tune (full, LoRA) and serve LLMs with JAX/XLA. See surojax.api for the Python API."""
__version__ = "0.1.0"

_API = ("Trainer", "TrainConfig", "build_trainer", "complete", "generate", "load_config", "load_model",
        "load_tokenizer", "save_model")


def __getattr__(name):  # the API is imported on first use, so `surojax --help` stays fast
    if name in _API:
        from surojax import api

        return getattr(api, name)
    raise AttributeError(f"module 'surojax' has no attribute {name!r}")
