"""Reading a run config: YAML (with duplicate keys refused), `section.key=value` overrides, the
model preset switch, and one `ConfigError` line per problem naming the key, the value and the
fix. Torch-free."""

from __future__ import annotations

import hashlib
import json
import os
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Literal, get_args, get_origin

import yaml
from pydantic import BaseModel, ValidationError

from m3run.model.config import PRESETS, ModelConfig
from m3run.runner.config.base import ConfigError, did_you_mean, show_value
from m3run.runner.config.schema import RunConfig

# ---------------------------------------------------------------------------------------------
# Loading

# A run config is a few KB; the caps refuse a wrong or hostile file before the YAML parser
# spends minutes on it or recurses past Python's stack (a RecursionError, not a message).
MAX_CONFIG_BYTES = 4 * 1024 * 1024
MAX_CONFIG_DEPTH = 32


def load_config(path: str | Path, overrides: Sequence[str] = ()) -> RunConfig:
    """Read a YAML run config, apply `section.key=value` overrides, validate.

    The data paths (data.train_path, data.val_path, data.sources[].path) come back absolute: a
    relative one written in the file is relative to the file's folder, one given by an
    override to the working directory. So a recipe works from any directory, and the config a
    launch freezes into its run dir means the same wherever the worker, `export` or a relaunch
    reads it.

    Raises ConfigError (a ValueError) for a missing or unreadable file, bad YAML, a malformed
    override, or any invalid value, with one line per problem.
    """
    path = Path(path)
    raw = _anchor_data_paths(_parse_yaml(_read_text(path), str(path)), path.absolute().parent)
    return _validate(raw, overrides, str(path), anchor=Path.cwd())


def _read_text(path: Path) -> str:
    if not path.is_file():
        what = "is a directory, not a file" if path.is_dir() else "not found"
        shown = str(path) if path.is_absolute() else f"{path} (resolved: {path.absolute()})"
        raise ConfigError(
            f"config file {what}: {shown} (fix: pass the path of a YAML run config, "
            "e.g. configs/demo_cpu.yaml)"
        )
    try:
        with path.open("rb") as f:
            # Read one byte past the cap rather than trust the size stat gave: a file can grow.
            data = f.read(MAX_CONFIG_BYTES + 1)
        if len(data) > MAX_CONFIG_BYTES:
            raise ConfigError(
                f"config file {path} is larger than {MAX_CONFIG_BYTES // 2**20} MiB, the limit "
                "for a run config (fix: pass the YAML run config, a few KB; data and token "
                "lists belong in data files, not in the config)"
            )
        return data.decode("utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"cannot read config file {path}: {e}") from e


def check_config_file(path: str | Path) -> None:
    """ConfigError for a config file that is missing, too large or nested too deep, without
    building it: cheap enough to run before a launch creates its run dir."""
    path = Path(path)
    _check_depth(_read_text(path), str(path))


def _check_depth(text: str, source: str) -> None:
    """ConfigError for YAML nested deeper than MAX_CONFIG_DEPTH. The event parser keeps its own
    stack, so walking the events cannot overflow where the recursive composer would."""
    depth = 0
    try:
        for event in yaml.parse(text, Loader=_Loader):
            if isinstance(event, yaml.CollectionStartEvent):
                depth += 1
                if depth > MAX_CONFIG_DEPTH:
                    line = event.start_mark.line + 1
                    raise ConfigError(
                        f"{source} nests mappings or lists more than {MAX_CONFIG_DEPTH} deep "
                        f"(at line {line}); a run config is sections of keys, two or three "
                        "levels (fix: flatten it, e.g. train: {lr: 3e-4})"
                    )
            elif isinstance(event, yaml.CollectionEndEvent):
                depth -= 1
    except yaml.YAMLError as e:
        raise ConfigError(f"invalid YAML in {source}:\n{e}") from e


def parse_config(
    text: str, overrides: Sequence[str] = (), *, source: str = "<string>"
) -> RunConfig:
    """Like `load_config`, from YAML text; `source` names it in error messages."""
    return _validate(_parse_yaml(text, source), overrides, source)


def _parse_yaml(text: str, source: str) -> dict:
    if len(text.encode("utf-8")) > MAX_CONFIG_BYTES:
        raise ConfigError(
            f"{source} is larger than {MAX_CONFIG_BYTES // 2**20} MiB, the limit for a run config "
            "(fix: pass the YAML run config, a few KB)"
        )
    _check_depth(text, source)
    try:
        raw = yaml.load(text, Loader=_Loader)  # _Loader is a SafeLoader
    except yaml.YAMLError as e:
        raise ConfigError(f"invalid YAML in {source}:\n{e}") from e
    except RecursionError:
        # Aliases can nest a structure deeper than its text shows.
        raise ConfigError(
            f"{source} nests too deep to load (fix: flatten it; a run config is sections of keys)"
        ) from None
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise ConfigError(
            f"{source} must be a YAML mapping of sections (model, train, data, ...), "
            f"got a {type(raw).__name__}"
        )
    return raw


def apply_overrides(cfg: RunConfig, overrides: Sequence[str]) -> RunConfig:
    """A new, validated config: `cfg` with `section.key=value` overrides applied in order."""
    return _validate(cfg.model_dump(mode="python"), overrides, "the config")


def config_hash(cfg: RunConfig) -> str:
    """sha256 (hex) of the canonical resolved dump; equal configs hash equal in any process.
    A LEGACY_VALUES key at its legacy value is left out, so a run frozen before the key existed
    keeps the hash its checkpoints and smoke record hold."""
    dump = cfg.model_dump(mode="json")
    for key, value in LEGACY_VALUES.items():
        section, name = key.split(".")
        if _same(dump[section][name], value):
            del dump[section][name]
    canonical = json.dumps(dump, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(canonical.encode("utf-8")).hexdigest()


# ---------------------------------------------------------------------------------------------
# Keys added after runs were frozen

# Keys the schema gained after runs were made, each with the value that keeps such a run's
# behaviour (a new run's default may differ: data.reset_at_eos is on for new runs,
# train.compile_scope compiles blocks, not the whole model, and model.A_activation is
# heavy_tail). A run dir's config.yaml is the resolved dump of every key, so one that lacks a
# key here was frozen before the key existed:
# `load_frozen_config` reads it at this value, `keep_legacy_values` keeps it on a relaunch that
# leaves the key unset, and `config_hash` leaves the key out at this value.
LEGACY_VALUES: dict[str, bool | int | str] = {
    "data.reset_at_eos": False,
    "train.compile_scope": "model",
    "train.deterministic": False,
    "supervisor.warm_spare": False,
    "supervisor.tune_scan": False,
    "model.A_activation": "softplus",
    # Host buffers change no result: a run frozen before the key gets the new default, under
    # the hash it was frozen with.
    "checkpoint.snapshot_buffers": 2,
}


def _same(value, legacy: bool | int | str) -> bool:
    """A config value equals a legacy one, type and all (True is not 1)."""
    return type(value) is type(legacy) and value == legacy


def load_frozen_config(path: str | Path) -> RunConfig:
    """A run dir's frozen config.yaml: like `load_config`, and each LEGACY_VALUES key the file
    lacks (it was frozen before the key existed) reads at its legacy value. A relative data
    path in it was frozen before paths were made absolute, when it meant the launch's working
    directory: it is read so, and a relaunch from there finds the same config."""
    path = Path(path)
    raw = _anchor_data_paths(_parse_yaml(_read_text(path), str(path)), Path.cwd())
    for key, value in LEGACY_VALUES.items():
        section, name = key.split(".")
        part = raw.get(section)
        if isinstance(part, Mapping) and name not in part:
            raw = {**raw, section: {**part, name: value}}
    return _validate(raw, (), str(path))


def keep_legacy_values(cfg: RunConfig, frozen: RunConfig) -> RunConfig:
    """`cfg`, a relaunch's config, with each LEGACY_VALUES key that it leaves unset and that
    the run's `frozen` config holds at the legacy value kept there: a run that trained under the
    old behaviour goes on so, and is not a changed config, under a recipe that leaves the key to
    its new default. Setting the key in the recipe or with --set is a change, as for any key."""
    kept = []
    for key, value in LEGACY_VALUES.items():
        section, name = key.split(".")
        unset = name not in getattr(cfg, section).model_fields_set
        if unset and _same(getattr(getattr(frozen, section), name), value):
            kept.append(f"{key}={json.dumps(value)}")
    return apply_overrides(cfg, kept) if kept else cfg


def _validate(
    raw: dict, overrides: Sequence[str], source: str, anchor: Path | None = None
) -> RunConfig:
    """`anchor`: the folder that relative data paths given by `overrides` are relative to."""
    if isinstance(overrides, str):  # a lone string would otherwise be split into characters
        overrides = [overrides]
    raw = _apply_raw_overrides(raw, overrides)
    if anchor is not None:
        raw = _anchor_data_paths(raw, anchor)
    try:
        return RunConfig.model_validate(raw)
    except ValidationError as e:
        by_key = {_override_key(o): o for o in overrides}
        lines = [_format_error(err, by_key) for err in e.errors()]
        where = f"{source} with overrides {' '.join(overrides)}" if overrides else source
        raise ConfigError(
            f"invalid config {where}:\n" + "\n".join(f"  - {ln}" for ln in lines)
        ) from None


# ---------------------------------------------------------------------------------------------
# Data paths


def _anchor_data_paths(raw: dict, base: Path) -> dict:
    """`raw` with each relative data path joined to `base` (`~` expanded first). Values of the
    wrong type are left for validation to name."""
    data = raw.get("data")
    if not isinstance(data, Mapping):
        return raw
    data = dict(data)
    for key in ("train_path", "val_path"):
        if key in data:
            data[key] = _anchored(data[key], base)
    if isinstance(data.get("sources"), list):
        data["sources"] = [
            {**s, "path": _anchored(s["path"], base)}
            if isinstance(s, Mapping) and "path" in s
            else s
            for s in data["sources"]
        ]
    return {**raw, "data": data}


def _anchored(value: Any, base: Path) -> Any:
    if not isinstance(value, str) or not value or "://" in value:
        return value  # a URL is not a path to anchor: validation or the loader names it
    return os.path.normpath(os.path.join(base, os.path.expanduser(value)))


# ---------------------------------------------------------------------------------------------
# Overrides


def _override_key(override: str) -> str:
    return override.partition("=")[0].strip()


def _apply_raw_overrides(raw: dict, overrides: Sequence[str]) -> dict:
    raw = {k: (dict(v) if isinstance(v, Mapping) else v) for k, v in raw.items()}
    sections = list(RunConfig.model_fields)
    for override in overrides:
        key, eq, text = override.partition("=")
        key = key.strip()
        if not eq:
            raise ConfigError(
                f"override {override!r} has no '=' (fix: write it as section.key=value, "
                "e.g. train.lr=1e-4)"
            )
        parts = key.split(".")
        if len(parts) != 2 or not all(parts):
            raise ConfigError(
                f"override {override!r}: expected section.key=value with exactly one dot in "
                f"the key, got key {key!r} (fix: e.g. train.lr=1e-4 or model.d_model=64)"
            )
        section, name = parts
        if section not in sections:
            raise ConfigError(
                f"override {override!r}: unknown section {section!r}"
                f"{did_you_mean(section, sections)} (fix: use one of {', '.join(sections)})"
            )
        value = _parse_scalar(text)
        current = raw.get(section, {})
        if section == "model" and isinstance(current, str):
            current = {"preset": current}
        if current is None:
            current = {}
        if not isinstance(current, Mapping):
            raise ConfigError(
                f"override {override!r}: section {section} is a {type(current).__name__}, "
                f"not a mapping (fix: make {section} a mapping of keys in the config file)"
            )
        current = dict(current)
        if section == "model" and name == "preset":
            current = _switch_preset(current)
        current[name] = value
        raw[section] = current
    return raw


def _switch_preset(model: dict) -> dict:
    """Drop the keys that only restate the old preset (or the defaults), so a new preset shows.

    A resolved dump lists every model field; without this, `model.preset=tiny` on a dumped
    434m config would be overruled by the 434m values. Keys that differ from the old preset
    are the user's own overrides and are kept on top of the new one.
    """
    base = ModelConfig().model_dump()
    old = model.get("preset")
    if isinstance(old, str) and old in PRESETS:
        base.update(PRESETS[old])
    return {k: v for k, v in model.items() if k == "preset" or k not in base or base[k] != v}


def _parse_scalar(text: str) -> Any:
    """An override value as YAML reads it (1e-4 → float, true → bool, null/empty → None).

    Text YAML cannot parse (e.g. a path starting with '@') is taken as a plain string.
    """
    text = text.strip()
    try:
        return yaml.load(text, Loader=_Loader)  # _Loader is a SafeLoader
    except yaml.YAMLError:
        return text


class _Loader(yaml.SafeLoader):
    """SafeLoader that reads `1e-4` as a float (YAML 1.2) and rejects duplicate keys."""

    def construct_mapping(self, node, deep=False):
        seen: dict[Any, Any] = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge" or not isinstance(
                key_node, yaml.ScalarNode
            ):
                continue
            if key_node.value in seen:
                raise yaml.constructor.ConstructorError(
                    "while constructing a mapping",
                    node.start_mark,
                    f"found duplicate key {key_node.value!r} (first at line "
                    f"{seen[key_node.value].line + 1}); delete one of them",
                    key_node.start_mark,
                )
            seen[key_node.value] = key_node.start_mark
        return super().construct_mapping(node, deep=deep)


# PyYAML follows YAML 1.1, where a float needs a dot: `lr: 3e-4` would load as the string
# "3e-4". Add the YAML 1.2 exponent-only forms.
_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*(?:\.[0-9_]*)?|\.[0-9_]+)[eE][-+]?[0-9]+$"),
    list("-+0123456789."),
)


# ---------------------------------------------------------------------------------------------
# Error messages


_FIX_HINTS = {
    "train.warmup_steps": (
        "set train.warmup_steps to a positive number of steps, e.g. 1–5% of train.total_steps"
    ),
}

_BOUNDS = {
    "greater_than_equal": ("≥", "ge"),
    "greater_than": (">", "gt"),
    "less_than_equal": ("≤", "le"),
    "less_than": ("<", "lt"),
}

_TYPE_PROBLEMS = {
    "int_parsing": "a whole number",
    "int_type": "a whole number",
    "int_from_float": "a whole number",
    "float_parsing": "a number",
    "float_type": "a number",
    "finite_number": "a finite number",
    "bool_parsing": "true or false",
    "bool_type": "true or false",
    "string_type": "a string",
    "model_type": "a mapping of keys",
    "model_attributes_type": "a mapping of keys",
    "dict_type": "a mapping of keys",
}


def _format_error(err: Mapping[str, Any], by_override: Mapping[str, str]) -> str:
    loc = tuple(str(p) for p in err["loc"])
    key = ".".join(loc)
    kind, ctx, value = err["type"], err.get("ctx") or {}, err.get("input")
    line = _describe(kind, loc, key, ctx, value, err["msg"])
    if key in by_override:
        line += f" [from override {by_override[key]}]"
    return line


def _describe(kind: str, loc: tuple[str, ...], key: str, ctx: Mapping, value: Any, msg: str) -> str:
    if kind == "extra_forbidden":
        parent, name = loc[:-1], loc[-1]
        valid = _valid_keys(parent)
        what = "section" if not parent else "key"
        hint = did_you_mean(name, valid, prefix=".".join(parent))
        fix = "rename or remove it" if hint else f"remove it; valid keys: {', '.join(valid)}"
        return f"unknown {what} {key}{hint} (fix: {fix})"
    if kind == "missing":
        if len(loc) == 1:
            return f"{key}: required section is missing (fix: add a `{key}:` section)"
        return f"{key}: required but missing (fix: add `{loc[-1]}:` under `{'.'.join(loc[:-1])}:`)"
    if kind in _BOUNDS:
        sign, name = _BOUNDS[kind]
        bound = ctx[name]
        if isinstance(bound, float) and bound.is_integer():
            bound = int(bound)  # pydantic reports `gt=0` on a float field as 0.0
        fix = _FIX_HINTS.get(key, f"set {key} to a value {sign} {bound}")
        return f"{key}: must be {sign} {bound}, got {show_value(value)} (fix: {fix})"
    if kind == "literal_error":
        choices = _literal_choices(loc)
        shown = ", ".join(show_value(c) for c in choices) or ctx.get("expected", "")
        hint = did_you_mean(str(value), [str(c) for c in choices])
        return (
            f"{key}: must be one of {shown}, got {show_value(value)}{hint} "
            f"(fix: set {key} to one of {shown})"
        )
    if kind in _TYPE_PROBLEMS:
        want = _TYPE_PROBLEMS[kind]
        return (
            f"{key or 'config'}: must be {want}, got {show_value(value)} (fix: set {key} to {want})"
        )
    if kind == "string_too_short":
        return f"{key}: must not be empty (fix: set {key})"
    if kind in ("value_error", "assertion_error"):
        text = str(ctx.get("error", msg)).removeprefix("Value error, ")
        if "fix:" not in text:
            text += f" (fix: change the {key or 'config'} section accordingly)"
        return f"{key}: {text}" if key and not text.startswith(key) else text
    return f"{key or 'config'}: {msg}, got {show_value(value)}"


def _model_at(loc: tuple[str, ...]) -> type[BaseModel] | None:
    cls: type[BaseModel] = RunConfig
    for part in loc:
        field = cls.model_fields.get(part)
        if field is None or not (
            isinstance(field.annotation, type) and issubclass(field.annotation, BaseModel)
        ):
            return None
        cls = field.annotation
    return cls


def _valid_keys(parent: tuple[str, ...]) -> list[str]:
    cls = _model_at(parent)
    if cls is None:
        return []
    keys = list(cls.model_fields)
    if cls is ModelConfig:
        keys.insert(0, "preset")
    return keys


def _literal_choices(loc: tuple[str, ...]) -> list[Any]:
    cls = _model_at(loc[:-1])
    field = cls.model_fields.get(loc[-1]) if cls is not None else None
    if field is None:
        return []
    ann = field.annotation
    candidates = [ann, *get_args(ann)]
    for c in candidates:
        if get_origin(c) is Literal:
            return list(get_args(c))
    return []
