"""What every section of the run configuration shares: the error type, the strict frozen base
model and the helpers that word a bad value. Torch-free."""

from __future__ import annotations

import difflib
from collections.abc import Mapping, Sequence
from typing import Any, get_args

from pydantic import BaseModel, ConfigDict, ValidationInfo, field_validator

from m3run.model.config import PRESETS


class ConfigError(ValueError):
    """A bad run configuration. The message is for the user: it names the key, value and fix."""


class _Section(BaseModel):
    # frozen: a validated config is a record (its hash stays true); use apply_overrides or
    # model_copy(update=...) to derive another. allow_inf_nan=False: `lr: .inf` is a typo.
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    @field_validator("*", mode="before")
    @classmethod
    def _no_boolean_numbers(cls, value: Any, info: ValidationInfo) -> Any:
        # pydantic reads True as 1 for a number field, and YAML reads yes/no/on/off as
        # booleans: `micro_batch_size: yes` must not become 1.
        if isinstance(value, bool):
            annotation = cls.model_fields[info.field_name].annotation
            kinds = get_args(annotation) or (annotation,)
            if bool not in kinds and any(k in (int, float) for k in kinds):
                raise ValueError(
                    f"must be a number, got the boolean {value!r} (YAML reads yes/no/on/off "
                    "as booleans): write a number"
                )
        return value


def did_you_mean(word: str, choices: Sequence[str], prefix: str = "") -> str:
    close = difflib.get_close_matches(word, list(choices), n=1, cutoff=0.6)
    if not close:
        return ""
    return f" — did you mean {prefix + '.' if prefix else ''}{close[0]}?"


def check_preset_name(preset: Any) -> None:
    if not isinstance(preset, str) or preset not in PRESETS:
        names = sorted(PRESETS)
        hint = did_you_mean(str(preset), names)
        raise ValueError(
            f"model.preset: unknown preset {show_value(preset)}{hint} "
            f"(fix: use one of {', '.join(names)}, or give the model fields explicitly)"
        )


def show_value(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return repr(value)
    if isinstance(value, Mapping):
        return "a mapping"
    if isinstance(value, list):
        return "a list"
    return str(value)
