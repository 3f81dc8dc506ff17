"""The kernel choices (surojax/kernel_settings.py): read from the SUROJAX_* variables once, typed, refused with
the variable's name when unknown, and every override listed for the start-up summaries."""
import pytest

from surojax.kernel_settings import (VARIABLES, Adam8bit, Fp8Accum, Fp8Dot, KernelSettings, QuantMatmul,
                                     kernel_settings, use_kernel_settings)


def test_defaults_and_overrides_from_the_environment():
    assert KernelSettings.from_environ({}) == KernelSettings() and KernelSettings().summary_lines() == []
    env = {"SUROJAX_FP8_DOT": "qdq", "SUROJAX_QUANT_MATMUL": " Pallas ", "SUROJAX_FP8_ACCUM": "split",
           "SUROJAX_ADAM8BIT": "", "PATH": "/bin"}
    s = KernelSettings.from_environ(env)
    assert (s.fp8_dot, s.quant_matmul, s.fp8_accum, s.adam8bit) == (Fp8Dot.QDQ, QuantMatmul.PALLAS, Fp8Accum.SPLIT,
                                                                    Adam8bit.AUTO)  # empty: unset
    # a variable set to its default is still an override that was set: listed too
    assert s.overrides() == {"SUROJAX_FP8_DOT": "qdq", "SUROJAX_FP8_ACCUM": "split", "SUROJAX_QUANT_MATMUL": "pallas"}
    (line,) = s.summary_lines()
    assert line.startswith("kernels ") and "SUROJAX_FP8_DOT=qdq" in line and "SUROJAX_QUANT_MATMUL=pallas" in line


@pytest.mark.parametrize("field", sorted(VARIABLES))
def test_an_unknown_value_names_its_variable_and_the_accepted_values(field):
    with pytest.raises(ValueError, match=rf"^{VARIABLES[field]}='nope': expected one of \w+"):
        KernelSettings.from_environ({VARIABLES[field]: "nope"})


def test_use_kernel_settings_holds_inside_the_block_only():
    before = kernel_settings()
    with use_kernel_settings(fp8_dot="qdq") as inside:
        assert kernel_settings() is inside and inside.fp8_dot is Fp8Dot.QDQ
        assert inside.overrides() == {"SUROJAX_FP8_DOT": "qdq"}  # a change made in code is listed as well
    assert kernel_settings() is before
