"""choose_layer_loop: the fastest candidate whose plan fits 90% of the capacity, constraints, user values kept."""
import dataclasses

import pytest

from surojax.bench.shapes import model_config
from surojax.models.layer_runner import Recompute
from surojax.offload.layer_loop_choice import USABLE_FRACTION, choose_layer_loop
from surojax.offload.memory_plan import GiB, plan_memory

# planned GiB per (recompute, rolled / unrolled) of a made-up run: unrolled none smaller than rolled none (as
# measured); keyed by a string because True == 1 as a dict key
SIZES = {("none", "unrolled"): 60, ("none", "rolled"): 70, ("full", "rolled"): 20, ("full", "unrolled"): 22,
         ("offload", "rolled"): 15, ("offload", "unrolled"): 16, ("dots", "rolled"): 50, ("dots", "unrolled"): 48}


@dataclasses.dataclass(frozen=True)
class FakePlan:
    total: int


def fake_plan(recompute, unroll):
    assert unroll is True or (unroll == 1 and not isinstance(unroll, bool))
    return FakePlan(SIZES[(recompute.value, "unrolled" if unroll is True else "rolled")] * GiB)


def choose(capacity_gib, recompute: str | None = None, **kw):
    """(recompute's name, "unrolled" or the unroll) chosen; `recompute` by its config name."""
    cap = None if capacity_gib is None else int(capacity_gib * GiB)
    c = choose_layer_loop(fake_plan, cap, recompute=None if recompute is None else Recompute(recompute), **kw)
    return c.recompute.value, ("unrolled" if c.unroll is True else c.unroll)


def test_fastest_that_fits_with_margin():
    assert choose(140) == ("none", "unrolled")
    assert choose(60 / USABLE_FRACTION + 0.01) == ("none", "unrolled")
    assert choose(60 / USABLE_FRACTION - 0.01) == ("full", 1)  # fits the device, not the 90%
    assert choose(20) == ("offload", 1)
    c = choose_layer_loop(fake_plan, 140 * GiB)
    assert c.reason == "recompute none, layers unrolled: planned 60.0 of 126.0 GiB usable fits (auto)"
    assert c.plan.total == 60 * GiB


def test_nothing_fits_returns_the_smallest_and_says_so():
    c = choose_layer_loop(fake_plan, 10 * GiB)
    assert (c.recompute, c.unroll) == (Recompute.OFFLOAD, 1) and "more than the 9.0 GiB usable" in c.reason


def test_no_capacity_is_rolled_without_recompute():
    assert choose(None) == ("none", 1)
    assert choose(None, offload_base=True) == ("full", 1)
    assert "no device capacity known" in choose_layer_loop(fake_plan, None).reason


def test_streaming_constraints():
    assert choose(140, offload_base=True) == ("full", 1)
    assert choose(18, offload_base=True) == ("offload", 1)
    assert choose(140, offload_base=True, prefetch=True) == ("full", 1)
    with pytest.raises(ValueError, match="recompute none"):
        choose(140, offload_base=True, recompute="none")
    with pytest.raises(ValueError, match="must be full"):
        choose(140, offload_base=True, prefetch=True, recompute="dots")


def test_user_values_kept():
    assert choose(140, recompute="dots") == ("dots", 1)
    assert choose(140, recompute="none") == ("none", "unrolled")
    assert choose(140, recompute="full", unroll=True) == ("full", "unrolled")
    assert choose(140, unroll=1) == ("none", 1)
    assert choose(60, unroll=1) == ("full", 1)
    assert choose(None, unroll=True) == ("none", "unrolled")
    c = choose_layer_loop(fake_plan, 10 * GiB, recompute=Recompute.NONE, unroll=1)
    assert (c.recompute, c.unroll) == (Recompute.NONE, 1) and "set in the config" in c.reason  # kept, even not fitting


def test_real_plans_on_the_h200():
    """With the real plan: Qwen3-0.6B LoRA b8 gets the fast loop on an H200, a 24 GiB card gets full + rolled;
    Qwen3-8B LoRA at batch 16 does not fit unrolled without recompute on 140 GiB."""
    def plan_fn(shape, batch):
        return lambda r, u: plan_memory(model_config(shape), mode="lora", batch=batch, seq=2048, recompute=r,
                                        unroll=u)

    h200 = 140 * GiB
    assert (c := choose_layer_loop(plan_fn("qwen3-0.6b", 8), h200)).recompute is Recompute.NONE and c.unroll is True
    assert (c := choose_layer_loop(plan_fn("qwen3-0.6b", 8), 24 * GiB)).recompute is Recompute.FULL and c.unroll == 1
    assert choose_layer_loop(plan_fn("qwen3-8b", 16), h200).recompute is Recompute.FULL
