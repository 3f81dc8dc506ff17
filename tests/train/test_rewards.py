"""GRPO reward functions: loading by name (built-ins, module:function from the working directory), clear errors,
and compute_rewards' weighted, NaN-aware totals (TRL: None is NaN, nansum, all-None rows unscorable)."""
import math
import sys

import numpy as np
import pytest

from surojax.train.rewards import (RewardFunctionError, RewardSettings, compute_rewards, load_reward_function,
                                   load_reward_functions)

USER_MODULE = '''
def brevity(prompts, completions, **columns):
    return [None if c == "skip" else -len(c) / 10 for c in completions]

def echo_column(prompts, completions, level, **columns):
    return [float(x) for x in level]

NOT_CALLABLE = 3
'''


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    """A module `my_rewards_<test>` in a fresh working directory, not importable from sys.path before the load."""
    name = f"my_rewards_{abs(hash(str(tmp_path))) % 10**8}"
    (tmp_path / f"{name}.py").write_text(USER_MODULE)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
    yield name
    sys.modules.pop(name, None)


def test_module_function_from_the_working_directory(user_module):
    fn = load_reward_function(f"{user_module}:brevity")
    assert fn.name == "brevity"
    np.testing.assert_allclose(fn(["p", "p"], ["abcd", "skip"], {}), [-0.4, math.nan])
    echo = load_reward_function(f"{user_module}:echo_column")
    np.testing.assert_allclose(echo(["p"], ["x"], {"level": [3]}), [3.0])


def test_load_errors_name_the_string(user_module):
    for spec, says in [("no_such_module_xyz:f", "no module 'no_such_module_xyz'"),
                       (f"{user_module}:missing", "has no 'missing'"),
                       (f"{user_module}:NOT_CALLABLE", "not callable"),
                       ("justaname", "module:function")]:
        with pytest.raises(RewardFunctionError) as e:
            load_reward_function(spec)
        assert says in str(e.value) and repr(spec) in str(e.value)
    with pytest.raises(RewardFunctionError, match="format_regex"):
        load_reward_function("format_regex")  # no pattern configured
    with pytest.raises(RewardFunctionError, match="returned 1 rewards for 2"):
        load_reward_function(f"{user_module}:echo_column")(["p", "q"], ["a", "b"], {"level": [1]})


def test_exact_match_on_the_quickstart_answers():
    """The quickstart's answers are sentences ending with the number ("Now Tom has 7."): the last numbers are
    compared; text answers are compared whole after whitespace normalisation; a missing value is None (NaN)."""
    fn = load_reward_function("exact_match", RewardSettings(exact_match_column="output"))
    completions = ["Now Tom has 7.", "Now Tom has 8.", " 7 ", "seven", "  Paris \n", "paris", "anything"]
    expected = ["Now Tom has 7.", "Now Tom has 7.", 7, "Now Tom has 7.", "Paris", "Paris", None]
    np.testing.assert_array_equal(fn(["q"] * 7, completions, {"output": expected}),
                                  [1.0, 0.0, 1.0, 0.0, 1.0, 0.0, math.nan])
    with pytest.raises(RewardFunctionError, match="no column 'answer'.*exact_match_column"):
        load_reward_function("exact_match")(["q"], ["7"], {"output": ["7"]})


def test_compute_rewards_weights_and_none(user_module):
    functions = load_reward_functions(["format_regex", f"{user_module}:brevity"],
                                      RewardSettings(format_regex=r"^<answer>.*</answer>$"))
    completions = ["<answer>7</answer>", "7", "skip", "<answer>\n1</answer>"]
    total, per = compute_rewards(functions, [2.0, 0.5], ["p"] * 4, completions, {"answer": ["7", "7", "1", "1"]})
    fmt = np.array([1.0, 0.0, 0.0, 1.0])
    brev = np.array([-1.8, -0.1, np.nan, -1.9])
    np.testing.assert_allclose(per["format_regex"], fmt)
    np.testing.assert_allclose(per["brevity"], brev)
    np.testing.assert_allclose(total, 2.0 * fmt + 0.5 * np.nan_to_num(brev))  # None left out of the sum
    only_none = load_reward_functions([f"{user_module}:brevity"])
    total, _ = compute_rewards(only_none, None, ["p", "p"], ["ab", "skip"], {})
    assert total[0] == pytest.approx(-0.2) and math.isnan(total[1])  # unscorable: NaN, advantage 0 later
    with pytest.raises(ValueError, match="2 reward weights for 1"):
        compute_rewards(only_none, [1.0, 1.0], ["p"], ["a"], {})
