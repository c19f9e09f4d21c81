"""Boundary validation: plain dicts (YAML, JSON bodies, RPC messages) into frozen dataclasses.

Every error names the field that is wrong (``fabric.pods: must be >= 1, got 0``). Used by every
spec in the project so that a scenario file, a REST body and an RPC message fail the same way.
"""
from __future__ import annotations

import dataclasses
import math
import typing
from typing import Any, Iterable, Mapping

BRIEF_CHARS = 60  # longest repr of a user value quoted in an error message
FEW_ITEMS = 5  # items of a list quoted in an error message before "... (N in all)"


class SpecError(ValueError):
    """A user-supplied value is wrong. ``field`` is the dotted path of the offending field."""

    def __init__(self, field: str, message: str):
        self.field = field
        self.message = message
        super().__init__(f"{field}: {message}" if field else message)


def brief(value: Any) -> str:
    """``repr(value)`` cut to BRIEF_CHARS (an error message quotes the input, never megabytes of it)."""
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) >= 10 ** BRIEF_CHARS:
        # repr would spend its time on the digits (and refuses past 4,300 of them)
        return f"an integer of about {int(value.bit_length() * math.log10(2)) + 1} digits"
    r = repr(value)
    return r if len(r) <= BRIEF_CHARS else f"{r[:BRIEF_CHARS - 15]}... ({len(r)} chars)"


def few(items: Iterable[Any], n: int = FEW_ITEMS) -> str:
    """The first ``n`` items of a list and the count: ``[1, 2, 3, 4, 5, ... (999999 in all)]``."""
    items = list(items)
    head = ", ".join(brief(x) for x in items[:n])
    return f"[{head}]" if len(items) <= n else f"[{head}, ... ({len(items)} in all)]"


def _join(path: str, name: str) -> str:
    return f"{path}.{name}" if path else name


# ``X | None`` (PEP 604) has this origin, not typing.Union: both are unions to check.
_UNION_ORIGINS = (typing.Union, type(int | None))


def _check_type(value: Any, tp: Any, field: str) -> Any:
    """Check (and lightly coerce: int -> float) ``value`` against annotation ``tp``."""
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if tp is Any:
        return value
    if origin in _UNION_ORIGINS:
        if value is None and type(None) in args:
            return None
        errors = []
        for a in args:
            if a is type(None):
                continue
            try:
                return _check_type(value, a, field)
            except SpecError as e:
                errors.append(e.message)
        raise SpecError(field, " or ".join(errors))
    if origin is typing.Literal:
        if isinstance(value, (list, dict)) or value not in args:
            raise SpecError(field, f"must be one of {', '.join(repr(a) for a in args)}, got {brief(value)}")
        return value
    if origin in (tuple, list):
        if not isinstance(value, (list, tuple)):
            raise SpecError(field, f"must be a list, got {type(value).__name__}")
        if origin is tuple and len(args) == 2 and args[1] is Ellipsis:
            return tuple(_check_type(v, args[0], f"{field}[{i}]") for i, v in enumerate(value))
        if origin is tuple and args:
            if len(value) != len(args):
                raise SpecError(field, f"must have {len(args)} items, got {len(value)}")
            return tuple(_check_type(v, a, f"{field}[{i}]") for i, (v, a) in enumerate(zip(value, args)))
        inner = args[0] if args else Any
        return [_check_type(v, inner, f"{field}[{i}]") for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, Mapping):
            raise SpecError(field, f"must be a mapping, got {type(value).__name__}")
        kt, vt = args if args else (Any, Any)
        return {_check_type(k, kt, f"{field}.<key>"): _check_type(v, vt, _join(field, str(k)))
                for k, v in value.items()}
    if dataclasses.is_dataclass(tp):
        if isinstance(value, tp):
            return value
        return from_dict(tp, value, field)
    if tp is float:
        return finite_float(value, field)
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise SpecError(field, f"must be an integer, got {type(value).__name__} {brief(value)}")
        return value
    if tp is bool:
        if not isinstance(value, bool):
            raise SpecError(field, f"must be true or false, got {brief(value)}")
        return value
    if tp is str:
        if not isinstance(value, str):
            raise SpecError(field, f"must be a string, got {type(value).__name__} {brief(value)}")
        return value
    if isinstance(tp, type) and not isinstance(value, tp):
        raise SpecError(field, f"must be {tp.__name__}, got {type(value).__name__}")
    return value


def finite_float(value: Any, field: str) -> float:
    """``value`` as a finite float; SpecError naming ``field`` for a non-number, inf, nan or a number too
    large for a float (a 401-digit integer)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise SpecError(field, f"must be a number, got {type(value).__name__} {brief(value)}")
    try:
        v = float(value)
    except OverflowError:
        raise SpecError(field, f"must be a finite number, got {brief(value)} (too large)") from None
    if not math.isfinite(v):
        raise SpecError(field, f"must be a finite number, got {value!r}")
    return v


def positive(value: Any, field: str, allow_zero: bool = False) -> float:
    """``value`` as a finite float > 0 (>= 0 with ``allow_zero``); SpecError naming ``field`` otherwise. The one
    home of the rule (files, the probe's and the commands' arguments)."""
    v = finite_float(value, field)
    require(v > 0 or (allow_zero and v == 0), field, f"must be {'>= 0' if allow_zero else '> 0'}, got {value!r}")
    return v


T = typing.TypeVar("T")


def from_dict(cls: type[T], data: Any, path: str = "") -> T:
    """Build frozen dataclass ``cls`` from ``data``.

    Unknown keys, missing required keys and wrong types raise :class:`SpecError` naming the field.
    After construction the dataclass's own ``__post_init__`` checks ranges (and raises SpecError).
    Nested dataclass fields are built recursively with dotted paths.
    """
    if not isinstance(data, Mapping):
        raise SpecError(path, f"must be a mapping, got {type(data).__name__}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    unknown = sorted((k for k in data if k not in fields), key=str)  # YAML keys need not be strings
    if unknown:
        raise SpecError(_join(path, str(unknown[0])[:BRIEF_CHARS]),
                        f"unknown key (known: {', '.join(sorted(fields))})")
    kwargs = {}
    for name, f in fields.items():
        fp = _join(path, name)
        if name not in data:
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                raise SpecError(fp, "is required")
            continue
        kwargs[name] = _check_type(data[name], hints[name], fp)
    try:
        return cls(**kwargs)
    except SpecError as e:
        if path and not e.field.startswith(path):
            raise SpecError(_join(path, e.field), e.message) from None
        raise


def to_dict(obj: Any) -> Any:
    """Dataclass -> plain JSON-able structure (tuples become lists)."""
    if dataclasses.is_dataclass(obj):
        return {f.name: to_dict(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, (list, tuple)):
        return [to_dict(v) for v in obj]
    if isinstance(obj, dict):
        return {k: to_dict(v) for k, v in obj.items()}
    return obj


def require(cond: bool, field: str, message: str) -> None:
    """Raise SpecError(field, message) unless ``cond`` (use in ``__post_init__``; never ``assert``)."""
    if not cond:
        raise SpecError(field, message)
