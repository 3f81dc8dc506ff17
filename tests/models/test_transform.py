"""models/transform.py: the order build_run applies transforms in, duplicate refusal, the trainable filter's union
(a transform that freezes the base) and the memory-plan settings' clash check, on toy transforms."""
from __future__ import annotations

import dataclasses

import pytest
from flax import nnx

from surojax.models.transform import (TRANSFORM_ORDER, StepHooks, Transform, apply_transforms, memory_settings,
                                      step_hooks, summary_lines, trainable_filter)


class Extra(nnx.Variable):
    """What a toy transform makes trainable."""


class Toy(nnx.Module):
    def __init__(self):
        self.w = nnx.Param(1.0)
        self.extra = Extra(2.0)
        self.log: list[str] = []


@dataclasses.dataclass
class Named:
    name: str
    freezes_base: bool = False
    trainable: object = None
    hooks: StepHooks | None = None
    memory: dict = dataclasses.field(default_factory=dict)
    line: str | None = None

    def apply(self, model):
        model.log.append(self.name)

    def summary(self):
        return self.line


def test_applied_in_documented_order_whatever_the_given_order():
    model = Toy()
    given = [Named(n) for n in reversed(TRANSFORM_ORDER) if n != "nvfp4"]
    assert all(isinstance(t, Transform) for t in given)
    applied = apply_transforms(model, given)
    expected = [n for n in TRANSFORM_ORDER if n != "nvfp4"]
    assert model.log == expected and [t.name for t in applied] == expected


def test_duplicate_and_unknown_names_are_refused_before_any_apply():
    model = Toy()
    with pytest.raises(ValueError, match="'lora' is given twice"):
        apply_transforms(model, [Named("lora"), Named("fp8"), Named("lora")])
    with pytest.raises(ValueError, match="'bogus' has no place"):
        apply_transforms(model, [Named("fp8"), Named("bogus")])
    assert model.log == []


def test_trainable_filter_is_the_union_and_freezes_base():
    model = Toy()
    trained = lambda ts: {p for p, _ in nnx.to_flat_state(nnx.state(model, trainable_filter(ts)))}  # noqa: E731
    assert trained([]) == {("w",)}  # every Param, nothing else
    assert trained([Named("fp8", trainable=Extra)]) == {("w",), ("extra",)}
    assert trained([Named("lora", freezes_base=True, trainable=Extra)]) == {("extra",)}
    with pytest.raises(ValueError, match="nothing trains"):
        trainable_filter([Named("lora", freezes_base=True)])


def test_memory_settings_merge_and_clash():
    a, b = Named("lora", memory={"rank": 8}), Named("placement", memory={"offload_base": True})
    assert memory_settings([a, b]) == {"rank": 8, "offload_base": True}
    with pytest.raises(ValueError, match="'rank' is set by two transforms"):
        memory_settings([a, Named("fp8", memory={"rank": 4})])


def test_hooks_and_summary_lines_in_order_skipping_none():
    h = StepHooks(before_micro=lambda *_: None)
    ts = [Named("lora", hooks=h, line="rank 8"), Named("fp8"), Named("placement", line="host")]
    assert step_hooks(ts) == [h]
    assert summary_lines(ts) == [("lora", "rank 8"), ("placement", "host")]


def test_fp8_transform_declares_what_its_scaling_needs():
    """fp8_scaling reaches the step and the memory plan through the FP8 transform only: delayed carries step state
    and two programs, full fine-tuning with current / delayed scaling caches the weights per step (a memory term)."""
    from surojax.precision.fp8_recipe import Fp8Transform
    from surojax.precision.fp8_scaling import Fp8Scaling, Fp8Settings

    def of(scaling, frozen_base):
        return Fp8Transform(Fp8Settings(scaling), frozen_base=frozen_base)

    delayed_full = of("delayed", False)
    assert delayed_full.settings.scaling is Fp8Scaling.DELAYED
    assert delayed_full.hooks.state is not None and delayed_full.hooks.compile is not None
    assert delayed_full.memory == {"fp8_weight_cache": True} and delayed_full.trainable is not None
    current_full = of("current", False)
    assert current_full.hooks.state is None and current_full.hooks.before_step is not None
    assert current_full.memory == {"fp8_weight_cache": True} and current_full.trainable is None
    for scaling, frozen in (("current", True), ("blockwise", False), ("blockwise", True)):
        t = of(scaling, frozen)
        assert t.hooks is None and t.memory == {} and t.trainable is None
    with pytest.raises(ValueError, match="fp8_scaling: 'sometimes'"):
        Fp8Settings("sometimes")


def test_the_step_takes_one_state_and_one_compile_hook():
    from surojax.train.step import make_train_step

    compiled = StepHooks(compile=lambda step, donated: step)
    with pytest.raises(ValueError, match="two transforms give the training step a 'compile' hook"):
        make_train_step(None, None, None, hooks=[compiled, compiled])
