"""A SUROJAX_* kernel override set in the environment is printed in the Trainer's start-up summary: a variable that
changes what compiles is never silent (surojax/kernel_settings.py)."""
from surojax.config import config_from_dict
from surojax.kernel_settings import KernelSettings, use_kernel_settings
from surojax.train.trainer import Trainer


def test_an_environment_override_is_in_the_start_up_summary(tiny_config):
    plain = Trainer(config_from_dict(tiny_config(max_steps=1)))
    try:
        assert not any("SUROJAX_" in line for line in plain.summary_lines())
        with use_kernel_settings(KernelSettings.from_environ({"SUROJAX_FP8_WGRAD": "weight"})):
            lines = plain.summary_lines()
    finally:
        plain.close()
    assert [line for line in lines if "SUROJAX_" in line] == [
        "kernels SUROJAX_FP8_WGRAD=weight (environment overrides for A/B runs: they change what compiles)"]
