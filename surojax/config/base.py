"""The pydantic base every config section derives from: unknown keys are errors, values are immutable.

Sections (run, data, lora, precision, optim, memory, parallel) are small models mixed into one flat
`TrainConfig`, so the YAML stays flat like Surogate's and Axolotl's while each concept lives in its own file.
"""
from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class StrictModel(BaseModel):
    """Forbids unknown keys, is frozen, dumps by YAML key (alias) name."""

    model_config = ConfigDict(
        extra="forbid",
        frozen=True,
        protected_namespaces=(),
        serialize_by_alias=True,
        validate_by_alias=True,
        validate_by_name=False,
        use_attribute_docstrings=True,
    )


def differs_from_default(model: BaseModel, key: str) -> bool:
    """`model`'s `key` differs from the field's default (writing a default value explicitly asks for nothing)."""
    return getattr(model, key) != type(model).model_fields[key].get_default(call_default_factory=True)
