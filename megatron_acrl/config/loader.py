"""Loading: YAML and dotted overrides to a typed, validated Config, and back."""

from __future__ import annotations

import ast
import difflib
import inspect
import math
import types
import typing
from dataclasses import fields, is_dataclass
from pathlib import Path
from typing import Any, Literal, get_args, get_origin

import yaml

from megatron_acrl.config._base import ConfigError, _raise_if
from megatron_acrl.config.algorithm import ALGORITHMS, AlgorithmConfig, FromRollout
from megatron_acrl.config.hf_arch import apply_hf_architecture
from megatron_acrl.config.rollout import RolloutConfig
from megatron_acrl.config.run import Config

Sources = dict[str, str]
"""Dotted field -> where its value came from, for the fields set by something other than the user
(today: ``algorithm.name=dapo`` and the like)."""


def _field_docs(cls: type) -> dict[str, str]:
    """Attribute docstrings: the string literal right after each annotated field."""
    try:
        tree = ast.parse(inspect.getsource(cls))
    except (OSError, TypeError):  # pragma: no cover - source unavailable
        return {}
    body = tree.body[0].body  # type: ignore[attr-defined]
    docs: dict[str, str] = {}
    for node, nxt in zip(body, body[1:], strict=False):
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            if (
                isinstance(nxt, ast.Expr)
                and isinstance(nxt.value, ast.Constant)
                and isinstance(nxt.value.value, str)
            ):
                docs[node.target.id] = " ".join(nxt.value.value.split())
    return docs


def _type_name(tp: Any) -> str:
    origin = get_origin(tp)
    if origin is Literal:
        return " | ".join(repr(a) for a in get_args(tp))
    if origin in (typing.Union, types.UnionType):
        return " | ".join("null" if a is type(None) else _type_name(a) for a in get_args(tp))
    if origin is tuple:
        args = get_args(tp)
        if len(args) == 2 and args[1] is Ellipsis:
            return f"list of {_type_name(args[0])}"
        return "[" + ", ".join(_type_name(a) for a in args) + "]"
    return getattr(tp, "__name__", str(tp))


def _coerce(value: Any, tp: Any, path: str) -> Any:
    """Check ``value`` against the annotation ``tp``; return the typed value or raise ConfigError."""
    origin = get_origin(tp)
    bad = ConfigError([(path, f"expected {_type_name(tp)}, got {value!r} ({type(value).__name__})")])
    if origin in (typing.Union, types.UnionType):
        args = get_args(tp)
        if value is None:
            if type(None) in args:
                return None
            raise bad
        for a in args:
            if a is type(None):
                continue
            try:
                return _coerce(value, a, path)
            except ConfigError:
                continue
        raise bad
    if origin is Literal:
        choices = get_args(tp)
        if value in choices:
            return value
        hint = difflib.get_close_matches(str(value), [str(c) for c in choices], n=1)
        msg = f"must be one of {', '.join(repr(c) for c in choices)}; got {value!r}"
        raise ConfigError([(path, msg + (f" (did you mean {hint[0]!r}?)" if hint else ""))])
    if origin is tuple:
        args = get_args(tp)
        if not isinstance(value, list | tuple):
            raise bad
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(_coerce(v, args[0], f"{path}[{i}]") for i, v in enumerate(value))
        if len(value) != len(args):
            raise ConfigError([(path, f"expected {len(args)} entries {_type_name(tp)}, got {list(value)!r}")])
        return tuple(_coerce(v, a, f"{path}[{i}]") for i, (v, a) in enumerate(zip(value, args, strict=True)))
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise bad
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise bad
    if tp is float:
        if isinstance(value, str):
            # YAML 1.1 reads "3e-3" (no dot) as a string; accept what float() accepts.
            try:
                value = float(value)
            except ValueError:
                raise bad from None
        if isinstance(value, int | float) and not isinstance(value, bool):
            if not math.isfinite(float(value)):
                raise ConfigError([(path, f"must be finite, got {value!r}")])
            return float(value)
        raise bad
    if tp is str:
        if isinstance(value, str):
            return value
        raise bad
    raise ConfigError([(path, f"unsupported field type {tp!r}")])  # pragma: no cover


def _optional_section(tp: Any) -> type | None:
    """The dataclass of an optional section (``LoraConfig | None``), else None."""
    if get_origin(tp) in (typing.Union, types.UnionType):
        args = [a for a in get_args(tp) if a is not type(None)]
        if len(args) == 1 and is_dataclass(args[0]) and len(get_args(tp)) == 2:
            return args[0]
    return None


def _build_field(tp: Any, value: Any, path: str) -> Any:
    if is_dataclass(tp):
        return _build(tp, value, path)
    section = _optional_section(tp)
    if section is not None:
        return None if value is None else _build(section, value, path)
    return _coerce(value, tp, path)


def _build(cls: type, data: Any, path: str) -> Any:
    if not isinstance(data, dict):
        raise ConfigError([(path or "<root>", f"expected a mapping of {cls.__name__} fields, got {data!r}")])
    hints = typing.get_type_hints(cls)
    names = [f.name for f in fields(cls)]
    errors: list[tuple[str, str]] = []
    kwargs: dict[str, Any] = {}
    for key, value in data.items():
        key_path = f"{path}.{key}" if path else str(key)
        if key not in names:
            hint = difflib.get_close_matches(str(key), names, n=1, cutoff=0.5)
            fix = (
                f"did you mean {(path + '.' if path else '') + hint[0]!r}?"
                if hint
                else (f"valid keys: {', '.join(names)}")
            )
            errors.append((key_path, f"unknown key; {fix}"))
            continue
        tp = hints[key]
        try:
            kwargs[key] = _build_field(tp, value, key_path)
        except ConfigError as err:
            errors += err.errors
    _raise_if(errors)
    try:
        obj = cls(**kwargs)
    except ConfigError as err:
        raise ConfigError([(f"{path}.{p}" if path and p else p or path, m) for p, m in err.errors]) from None
    return obj


def _set_dotted(data: dict, dotted: str, value: Any) -> None:
    keys = dotted.split(".")
    node = data
    for k in keys[:-1]:
        nxt = node.setdefault(k, {})
        if not isinstance(nxt, dict):
            raise ConfigError([(dotted, f"cannot set a sub-key of {k!r}, which is not a section")])
        node = nxt
    node[keys[-1]] = value


def parse_overrides(overrides: list[str]) -> dict:
    """Turn ``["a.b=1", "c.d=[1, 2]"]`` into a nested dict; values are parsed as YAML scalars."""
    data: dict = {}
    for item in overrides:
        if "=" not in item:
            raise ConfigError(
                [(item, "override must look like section.key=value, e.g. correction.gamma=0.8")]
            )
        key, raw = item.split("=", 1)
        try:
            value = yaml.safe_load(raw) if raw.strip() else ""
        except yaml.YAMLError as err:
            raise ConfigError([(key, f"cannot parse value {raw!r}: {err}")]) from None
        _set_dotted(data, key.strip(), value)
    return data


def _merge(base: dict, extra: dict) -> dict:
    out = dict(base)
    for k, v in extra.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def _duplicate_keys(node: yaml.Node | None, path: str = "") -> list[tuple[str, int, int]]:
    """Keys given twice in one mapping of the composed YAML ``node`` (a section or a field), as
    (dotted path, line, first line), lines 1-based: plain YAML silently keeps the last one."""
    found: list[tuple[str, int, int]] = []
    if isinstance(node, yaml.MappingNode):
        seen: dict[str, int] = {}
        for key_node, value in node.value:
            key, line = str(key_node.value), key_node.start_mark.line + 1
            dotted = f"{path}.{key}" if path else key
            if key in seen:
                found.append((dotted, line, seen[key]))
            seen.setdefault(key, line)
            found += _duplicate_keys(value, dotted)
    elif isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            found += _duplicate_keys(item, f"{path}[{i}]")
    return found


def _read_yaml(p: Path) -> Any:
    """The YAML file ``p``, refusing a key given twice (ConfigError naming file:line and the key)."""
    text = p.read_text()
    try:
        dups = _duplicate_keys(yaml.compose(text, Loader=yaml.SafeLoader))
        data = yaml.safe_load(text)
    except yaml.YAMLError as err:
        raise ConfigError([("", f"{p} is not valid YAML: {err}")]) from None
    if dups:
        raise ConfigError(
            [
                (
                    key,
                    f"{p}:{line}: {key.rsplit('.', 1)[-1]!r} is given twice (first on line {first}); YAML "
                    "would keep only the second and drop the first's keys: merge them into one entry",
                )
                for key, line, first in dups
            ]
        )
    return data


def _rollout_of(data: dict) -> RolloutConfig | None:
    """The rollout section ``data`` describes, or None where it is invalid (the full build then
    names its errors together with every other section's)."""
    try:
        return _build(RolloutConfig, data.get("rollout", {}), "rollout")
    except ConfigError:
        return None


def apply_name_defaults(data: dict) -> tuple[dict, Sources]:
    """``data`` with ``algorithm.name``'s values (:data:`~megatron_acrl.config.algorithm.ALGORITHMS`:
    its defaults and required fields) filled into every algorithm field ``data`` leaves unset, and
    the fields so filled, each mapped to ``"algorithm.name=NAME"``. A field ``data`` sets keeps its
    value; an unknown or ill-typed name fills nothing (the build refuses it, naming the valid ones)."""
    section = data.get("algorithm", {}) if isinstance(data, dict) else None
    if not isinstance(section, dict):
        return data, {}
    name = section.get("name", AlgorithmConfig.name)
    spec = ALGORITHMS.get(name) if isinstance(name, str) else None
    if spec is None:
        return data, {}
    filled, sources = dict(section), {}
    for key, value in {**spec.defaults, **spec.requires}.items():
        if key in section:
            continue  # the user's value wins
        source = f"algorithm.name={name}"
        if isinstance(value, FromRollout):
            rollout = _rollout_of(data)
            if rollout is None:
                continue
            value, source = value.rule(rollout), f"{source}: {value.says}"
        filled[key] = value
        sources[f"algorithm.{key}"] = source
    return {**data, "algorithm": filled}, sources


ASYNC_SOURCE = "rollout.mode=async: the lag sweep's pick, docs/study/REPORT.md"
"""What ``--explain`` names as the source of the correction fields an async run gets by default."""


def apply_async_correction_defaults(data: dict) -> tuple[dict, Sources]:
    """``data`` with the correction the lag sweep picked for stale rollouts filled into an async
    run's correction fields it leaves unset: ``method: tis`` and ``step_control: drift_budget`` (TIS
    + step control was the pick at lags 0, 2 and 8; at lag 8 exact J 0.749 against TIS's 0.390 and
    BF16 sync's 0.759) and, when the run chooses ACRL, ``alpha_min: 0`` (sign-safe ACRL beat the
    paper's law at lag 8 on 6/6 seeds). A sync run is unchanged (its weight lag is an explicit
    experiment: the study grids set what they compare). Returns the data and the fields so filled."""
    rollout = data.get("rollout", {}) if isinstance(data, dict) else None
    if not isinstance(rollout, dict) or rollout.get("mode") != "async":
        return data, {}
    section = data.get("correction", {})
    if not isinstance(section, dict):
        return data, {}
    filled, sources = dict(section), {}
    wanted: dict[str, Any] = {"method": "tis", "step_control": "drift_budget"}
    if section.get("method") == "acrl":  # the user's ACRL: sign-safe
        wanted["alpha_min"] = 0.0
    for key, value in wanted.items():
        if key not in section:
            filled[key] = value
            sources[f"correction.{key}"] = ASYNC_SOURCE
    return {**data, "correction": filled}, sources


def config_with_sources(data: dict) -> tuple[Config, Sources]:
    """:func:`config_from_dict` and the fields ``algorithm.name`` set (:func:`apply_name_defaults`),
    an async run's correction defaults (:func:`apply_async_correction_defaults`) and
    ``model.hf_path``'s config.json set (:func:`apply_hf_architecture`)."""
    data, sources = apply_name_defaults(data)
    data, from_async = apply_async_correction_defaults(data)
    data, from_hf = apply_hf_architecture(data)
    return _build(Config, data, ""), {**sources, **from_async, **from_hf}


def config_from_dict(data: dict) -> Config:
    """Build and validate a :class:`Config` from a nested dict (as read from YAML); the algorithm
    name's values fill the algorithm fields the dict leaves unset."""
    return config_with_sources(data)[0]


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> Config:
    """Load ``path`` (YAML; None means all defaults), apply dotted ``overrides``, validate."""
    return load_config_with_sources(path, overrides)[0]


def load_config_with_sources(
    path: str | Path | None = None, overrides: list[str] | None = None
) -> tuple[Config, Sources]:
    """:func:`load_config` and the fields ``algorithm.name`` set (what ``--explain CONFIG`` marks)."""
    data: dict = {}
    if path is not None and str(path) != "":
        p = Path(path)
        if not p.is_file():
            raise ConfigError([("", f"config file not found: {p} (pass a YAML file from configs/)")])
        data = _read_yaml(p) or {}
        if not isinstance(data, dict):
            raise ConfigError([("", f"{p} must hold a mapping of sections, got {type(data).__name__}")])
    data = _merge(data, parse_overrides(overrides or []))
    return config_with_sources(data)


def config_to_dict(cfg: Any) -> dict:
    """Plain nested dict (tuples as lists) suitable for YAML, W&B and checkpoints."""

    def conv(v: Any) -> Any:
        if is_dataclass(v):
            return {f.name: conv(getattr(v, f.name)) for f in fields(v)}
        if isinstance(v, tuple):
            return [conv(x) for x in v]
        return v

    return conv(cfg)


def explain(cfg: Config | None = None, sources: Sources | None = None) -> list[str]:
    """One line per field: dotted path, type, value and doc. The values are the defaults, or
    ``cfg``'s (a loaded config) with ``(from algorithm.name=...)`` after each field in ``sources``."""
    return _explain_section(Config, cfg if cfg is not None else Config(), "", sources or {})


def _explain_section(cls: type, section: Any, prefix: str, sources: Sources) -> list[str]:
    """:func:`explain`'s lines of one section ``section`` (an instance of ``cls``)."""
    lines: list[str] = []
    docs = _field_docs(cls)
    hints = typing.get_type_hints(cls)
    for f in fields(cls):
        tp = hints[f.name]
        path = f"{prefix}{f.name}"
        sub = tp if is_dataclass(tp) else _optional_section(tp)
        if sub is not None and (is_dataclass(tp) or getattr(section, f.name) is not None):
            lines.append(f"[{path}]  {docs.get(f.name, '')}")
            lines += _explain_section(sub, getattr(section, f.name), path + ".", sources)
        else:
            value = config_to_dict(getattr(section, f.name))  # tuples as lists, as YAML writes them
            origin = f"  (from {sources[path]})" if path in sources else ""
            lines.append(
                f"  {path}: {_type_name(tp)} = {value!r}{origin}\n      {docs.get(f.name, '(undocumented)')}"
            )
    return lines
