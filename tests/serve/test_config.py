"""ServeConfig: the CLI's options fill it and its defaults are the CLI's (one default per setting); bad values
are refused where the config is built."""
import pytest

from surojax.cli.main import build_parser, load_command
from surojax.cli.serve import ServeOptionError, serve_config
from surojax.serve.config import EngineConfig, KVPath, SchedulerConfig, ServeConfig


def _parse(*argv):
    return build_parser("serve", load_command("serve")).parse_args(["serve", "m", *argv])


def test_defaults_are_the_configs():
    assert serve_config(_parse()) == ServeConfig(model="m")


def test_options_fill_the_config():
    c = serve_config(_parse("--max-num-batched-tokens", "2", "--block-size", "8", "--kv-path", "reference",
                            "--enable-lora", "--lora-modules", "a=/x", "--decode-steps", "4", "--port", "9"))
    assert c.engine.scheduler == SchedulerConfig(max_num_batched_tokens=8, decode_steps=4)  # raised to one block
    assert c.engine.kv_path is KVPath.REFERENCE and c.engine.block_size == 8 and c.port == 9
    assert c.lora.modules == (("a", "/x"),)


def test_bad_values_are_refused():
    with pytest.raises(ServeOptionError, match="needs --enable-lora"):
        serve_config(_parse("--lora-modules", "a=/x"))
    with pytest.raises(ServeOptionError, match="NAME=PATH"):
        serve_config(_parse("--enable-lora", "--lora-modules", "a"))
    with pytest.raises(ValueError, match="power of two"):
        SchedulerConfig(decode_steps=3)
    with pytest.raises(ValueError, match="memory_utilization"):
        EngineConfig(memory_utilization=1.5)


def test_the_server_turns_on_the_persistent_compilation_cache_before_it_builds(monkeypatch):
    """`surojax serve` enables JAX's compilation cache (as training does; a no-op on a CPU) before the model loads
    and compiles, so a restarted server loads its compiled calls from disk."""
    import types

    import uvicorn

    from surojax.serve import launch

    order = []
    monkeypatch.setattr(launch, "enable_compilation_cache", lambda platform: order.append(("cache", platform)))
    engine = types.SimpleNamespace(shutdown=lambda: order.append("shutdown"))
    monkeypatch.setattr(launch, "build_server", lambda config: (order.append("build") or "app",
                                                                 types.SimpleNamespace(engine=engine)))
    monkeypatch.setattr(launch, "freeze_heap", lambda: None)
    monkeypatch.setattr(uvicorn, "run", lambda app, **kw: order.append(("run", app)))
    assert launch.serve(ServeConfig(model="m")) == 0
    assert order == [("cache", "cpu"), "build", ("run", "app"), "shutdown"]
