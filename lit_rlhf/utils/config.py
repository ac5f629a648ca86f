"""Typed, validated configs: Hydra/OmegaConf nodes → dataclasses, errors that name the key.

Every component that users configure (algo, model, data) declares a dataclass. Building it
through :func:`build_config` rejects unknown keys (with a "did you mean" hint and the allowed
keys), wrong types, values outside a declared range (``field(metadata={"ge": 0})``) and values
outside a ``Literal`` set, each message naming the full config key (``algo.lr``). Cross-field
checks live in the dataclass's ``validate()`` and raise :class:`ConfigError` with a key.
"""

from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from collections.abc import Mapping
from typing import Any, Literal, TypeVar, Union, get_args, get_origin

from lit_rlhf.utils.errors import UserError

T = TypeVar("T")


class ConfigError(UserError, ValueError):
    """A bad configuration value; ``key`` is the full dotted config key when known."""

    def __init__(self, key: str, message: str) -> None:
        self.key = key
        self.message = message
        super().__init__(f"{key}: {message}" if key else message)

    def under(self, prefix: str) -> ConfigError:
        """The same error with ``prefix.`` in front of its key."""
        key = f"{prefix}.{self.key}" if prefix and self.key else (prefix or self.key)
        return ConfigError(key, self.message)


def _to_plain(values: Any, prefix: str) -> Any:
    """OmegaConf containers → plain dicts/lists (resolving interpolations); others unchanged.

    A mandatory value left as ``???`` raises a ConfigError naming its key.
    """
    try:
        from omegaconf import DictConfig, ListConfig, OmegaConf
        from omegaconf.errors import MissingMandatoryValue
    except ImportError:  # pragma: no cover - omegaconf is a core dependency
        return values
    if isinstance(values, (DictConfig, ListConfig)):
        try:
            return OmegaConf.to_container(values, resolve=True, throw_on_missing=True)
        except MissingMandatoryValue as err:
            key = err.full_key or prefix
            raise ConfigError(key, f"is required (??? in the config): set it, e.g. {key}=…") from None
    return values


def _type_name(tp: Any) -> str:
    if get_origin(tp) is Literal:
        return " | ".join(repr(a) for a in get_args(tp))
    return getattr(tp, "__name__", str(tp).replace("typing.", ""))


def _coerce(value: Any, tp: Any, key: str) -> Any:
    """Check ``value`` against the annotation ``tp``; return it (ints widened to float)."""
    origin = get_origin(tp)
    if tp is Any or tp is object:
        return value
    if origin in (Union, types.UnionType):
        args = get_args(tp)
        if value is None and type(None) in args:
            return None
        concrete = [a for a in args if a is not type(None)]
        if len(concrete) == 1:  # Optional[X]: X's own error is the precise one (nested key, range)
            return _coerce(value, concrete[0], key)
        for arg in concrete:
            try:
                return _coerce(value, arg, key)
            except ConfigError:
                continue
        allowed = " or ".join(_type_name(a) for a in args)
        raise ConfigError(key, f"expected {allowed}, got {value!r}")
    if origin is Literal:
        choices = get_args(tp)
        if value not in choices:
            raise ConfigError(key, f"must be one of {list(choices)}, got {value!r}")
        return value
    if dataclasses.is_dataclass(tp):
        if isinstance(value, tp):
            return value
        if not isinstance(value, Mapping):
            raise ConfigError(key, f"expected a mapping for {tp.__name__}, got {value!r}")
        return build_config(tp, value, prefix=key)
    if origin in (list, tuple, typing.Sequence):
        if not isinstance(value, (list, tuple)):
            raise ConfigError(key, f"expected a list, got {value!r}")
        (item_tp, *_) = get_args(tp) or (Any,)
        items = [_coerce(v, item_tp, f"{key}[{i}]") for i, v in enumerate(value)]
        return tuple(items) if origin is tuple else items
    if origin in (dict, typing.Mapping) or tp is dict:
        if not isinstance(value, Mapping):
            raise ConfigError(key, f"expected a mapping, got {value!r}")
        return dict(value)
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(key, f"expected true or false, got {value!r}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(key, f"expected an integer, got {value!r}")
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(key, f"expected a number, got {value!r}")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(key, f"expected a string, got {value!r}")
        return value
    return value


_RANGE_CHECKS = {
    "gt": (">", lambda v, b: v > b),
    "ge": (">=", lambda v, b: v >= b),
    "lt": ("<", lambda v, b: v < b),
    "le": ("<=", lambda v, b: v <= b),
}


def _check_range(value: Any, meta: Mapping[str, Any], key: str) -> None:
    """Enforce ``field(metadata={"gt"|"ge"|"lt"|"le": bound})`` on a number."""
    if value is None or isinstance(value, bool) or not isinstance(value, (int, float)):
        return
    declared = [(op, meta[name], ok) for name, (op, ok) in _RANGE_CHECKS.items() if name in meta]
    if not all(ok(value, bound) for _, bound, ok in declared):
        wanted = " and ".join(f"{op} {bound}" for op, bound, _ in declared)
        raise ConfigError(key, f"must be {wanted}, got {value!r}")


def build_config(cls: type[T], values: Mapping[str, Any] | None, prefix: str = "") -> T:
    """Build dataclass ``cls`` from a mapping, validating keys, types, ranges and choices.

    Keys starting with ``_`` (Hydra's ``_target_``, ``_partial_``) are ignored.

    Raises:
        ConfigError: naming ``prefix.key`` and what is allowed.
    """
    values = dict(_to_plain(values, prefix) or {})
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    hints = typing.get_type_hints(cls)
    kwargs: dict[str, Any] = {}
    for name, value in values.items():
        if name.startswith("_"):
            continue
        key = f"{prefix}.{name}" if prefix else name
        if name not in fields:
            close = difflib.get_close_matches(name, list(fields), n=1)
            hint = f" Did you mean '{close[0]}'?" if close else ""
            from lit_rlhf.utils.secrets import top_level_hint

            hint += top_level_hint(key)
            raise ConfigError(key, f"unknown key for {cls.__name__}.{hint} Allowed keys: {', '.join(sorted(fields))}")
        default = _default_of(fields[name])
        if dataclasses.is_dataclass(default) and isinstance(value, Mapping):
            # a partial nested mapping overrides the field's OWN default (e.g. PPO's rollout
            # sampling settings), not the nested class's defaults: as the Hydra schema merge does
            value = {**to_dict(default), **value}
        coerced = _coerce(value, hints[name], key)
        _check_range(coerced, fields[name].metadata, key)
        kwargs[name] = coerced
    try:
        obj = cls(**kwargs)
    except ConfigError as err:
        raise err.under(prefix) from None
    validate = getattr(obj, "validate", None)
    if callable(validate):
        try:
            validate()
        except ConfigError as err:
            raise err.under(prefix) from None
    return obj


def _default_of(f: dataclasses.Field) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
        return f.default_factory()  # type: ignore[misc]
    return None


def to_dict(obj: Any) -> Any:
    """A dataclass config as a plain (YAML/JSON-able) dict, for hyper-parameter logging."""
    if dataclasses.is_dataclass(obj):
        return {f.name: to_dict(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, (list, tuple)):
        return [to_dict(v) for v in obj]
    if isinstance(obj, dict):
        return {k: to_dict(v) for k, v in obj.items()}
    return obj


def check(condition: bool, key: str, message: str) -> None:
    """Raise ``ConfigError(key, message)`` unless ``condition``: for ``validate()`` methods."""
    if not condition:
        raise ConfigError(key, message)


def resolve_config(
    cls: type[T], config: T | Mapping[str, Any] | None, kwargs: Mapping[str, Any], prefix: str = ""
) -> T:
    """A component's config from either a ready dataclass, a mapping, or keyword arguments.

    Lets users write ``SFTDataModule(SFTDataConfig(...))``, ``SFTDataModule(batch_size=8)`` or
    (train.py) ``SFTDataModule(build_config(...))`` and get the same validation each way.
    """
    if config is not None and kwargs:
        raise TypeError(f"pass either a {cls.__name__} or keyword arguments, not both")
    if isinstance(config, cls):
        return config
    return build_config(cls, config if config is not None else kwargs, prefix)


def check_call_arguments(fn: Any, values: Mapping[str, Any] | None, prefix: str) -> None:
    """Check a config node meant for ``fn(**values)`` (e.g. ``trainer.*`` for ``Trainer``) against
    ``fn``'s signature and type hints: an unknown key or a value of the wrong type fails naming
    ``prefix.key`` (``trainer.max_steps: expected an integer, got 'abc'``) instead of deep inside ``fn``."""
    import inspect

    values = dict(_to_plain(values, prefix) or {})
    params = inspect.signature(fn).parameters
    open_kwargs = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    try:
        hints = typing.get_type_hints(fn)
    except Exception:  # unresolvable annotations: names are still checked
        hints = {}
    for name, value in values.items():
        if name.startswith("_"):
            continue
        key = f"{prefix}.{name}"
        if name not in params:
            if open_kwargs:
                continue
            close = difflib.get_close_matches(name, list(params), n=1)
            hint = f" Did you mean '{close[0]}'?" if close else ""
            raise ConfigError(key, f"unknown argument of {getattr(fn, '__qualname__', fn)}.{hint}")
        if name in hints and value is not None:
            _coerce(value, hints[name], key)
