"""Extension points are registries (pure, the ground floor): one :class:`Registry` per kind of decision or model
the testbed lets a user replace (dispatch, planner, balancer: testbed.orchestrator.interfaces; the fabric's
phase rule: controller.fabric_rules; RLSim's fabrics: rlsim.fabrics; the backends: testbed.backends).

A user names a plug-in by

* a registered name (``forecast``, ``contiguous``, ``rfabric``...): the built-ins are registered like any
  plug-in, as ``"package.module:Class"`` paths imported when first asked for (so a registry on a low floor
  names classes that live higher up without importing them);
* a dotted path ``"package.module:Class"`` (``module.path.Class`` is accepted too): imported when resolved;
* the name of a Python entry point in the registry's group (``orchestrrl.planners``, ...), for an installed
  package (as Vidur's scheduler registries and vLLM's ``--scheduler-cls`` do).

:meth:`Registry.resolve` checks what it found against the interface (a class; every method the interface
requires, implemented) and :meth:`Registry.params` validates a plug-in's parameters into its own frozen
dataclass ``Params``: an unknown plug-in, a path that does not import, a class that does not implement the
interface or a bad parameter is a :class:`~emulation.validation.SpecError` naming the field, raised before
anything starts. A plug-in whose decision cannot be carried out at run time raises :class:`DecisionError`:
the run stops, everything it started is stopped.
"""
from __future__ import annotations

import dataclasses
import importlib
import importlib.metadata
import inspect
import re
from typing import Any, Mapping

from .validation import SpecError, brief, from_dict

NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.+-]*$")  # a registered or entry-point name
ENTRY_POINT_PREFIX = "orchestrrl."


class DecisionError(RuntimeError):
    """A plug-in decided something that cannot be carried out (a layout no server can hold, a migration of a
    request that is not on its source...). ``who``: the plug-in (its role and name); the run stops."""

    def __init__(self, who: str, message: str):
        self.who = who
        self.message = message
        super().__init__(f"{who}: {message}")


def check_ref(ref: Any, field: str) -> str:
    """The form of a plug-in reference (a name, or ``module:Attr``), checked where a scenario loads; what it
    names is resolved by the registry that owns the interface."""
    if not isinstance(ref, str) or not ref.strip():
        raise SpecError(field, f"must name a plug-in (a registered name or 'package.module:Class'), got {brief(ref)}")
    mod, colon, attr = ref.partition(":")
    if colon:
        if not (_is_dotted(mod) and attr.isidentifier()):
            raise SpecError(field, f"{ref!r} is not a path of the form 'package.module:Class'")
    elif not NAME_RE.match(ref):
        raise SpecError(field, f"{ref!r} is neither a plug-in name nor a path 'package.module:Class'")
    return ref


def _is_dotted(text: str) -> bool:
    return bool(text) and all(p.isidentifier() for p in text.split("."))


class Registry:
    """Named implementations of one interface. ``interface``: the abstract base class whose abstract methods a
    plug-in must implement (it need not subclass it); ``builtins``: name -> ``"module:Class"`` (or the object),
    resolved lazily; ``group``: the entry-point group, ``orchestrrl.<group>``."""

    def __init__(self, kind: str, interface: type, group: str, builtins: Mapping[str, Any] | None = None):
        self.kind = kind
        self.interface = interface
        self.group = ENTRY_POINT_PREFIX + group
        self._entries: dict[str, Any] = dict(builtins or {})
        self._loaded: dict[str, Any] = {}

    # ---- registration ----
    def register(self, name: str, obj: Any = None):
        """Register ``obj`` (a class or a ``"module:Class"`` path) under ``name``; as a decorator without
        ``obj``. A name registered twice is a ValueError (one home per name)."""
        if not NAME_RE.match(name or ""):
            raise ValueError(f"{self.kind}: {name!r} is not a valid plug-in name")

        def add(o):
            if name in self._entries:
                raise ValueError(f"{self.kind} {name!r} is registered already")
            self._entries[name] = o
            return o

        return add if obj is None else add(obj)

    def names(self) -> tuple[str, ...]:
        """The registered names (entry points not included)."""
        return tuple(self._entries)

    def known(self) -> str:
        return (f"known: {', '.join(self._entries)}; or a path 'package.module:Class', or an entry point in "
                f"group {self.group}")

    # ---- resolution ----
    def resolve(self, ref: Any, field: str) -> Any:
        """The implementation ``ref`` names (a registered name, a dotted path or an entry point), checked
        against the interface; SpecError naming ``field`` otherwise."""
        check_ref(ref, field)
        if ref in self._loaded:
            return self._loaded[ref]
        if ref in self._entries:
            obj = self._entries[ref]
            if isinstance(obj, str):
                obj = _import(obj, field, f"{self.kind} {ref!r}")
        elif ":" in ref or "." in ref:
            obj = _import(ref, field, ref)
        else:
            obj = self._entry_point(ref, field)
        self.check(obj, ref, field)
        self._loaded[ref] = obj
        return obj

    def _entry_point(self, ref: str, field: str) -> Any:
        try:
            eps = [ep for ep in importlib.metadata.entry_points(group=self.group) if ep.name == ref]
        except Exception:  # noqa: BLE001 - a broken installation's metadata: no entry points
            eps = []
        if not eps:
            raise SpecError(field, f"unknown {self.kind} {ref!r} ({self.known()})")
        try:
            return eps[0].load()
        except Exception as e:  # noqa: BLE001 - whatever the plug-in's import raises
            raise SpecError(field, f"entry point {ref!r} ({eps[0].value}) does not import: "
                                   f"{type(e).__name__}: {e}") from None

    def check(self, obj: Any, ref: str, field: str) -> None:
        """``obj`` implements the interface: a class with every abstract method of ``interface`` implemented."""
        if not inspect.isclass(obj):
            raise SpecError(field, f"{ref!r} is a {type(obj).__name__}, not a class implementing the "
                                   f"{self.kind} interface ({_iface(self.interface)})")
        missing = [m for m in sorted(getattr(self.interface, "__abstractmethods__", ()))
                   if not callable(getattr(obj, m, None)) or getattr(getattr(obj, m), "__isabstractmethod__", False)]
        if missing:
            raise SpecError(field, f"{ref!r} does not implement the {self.kind} interface: it lacks "
                                   f"{', '.join(m + '()' for m in missing)} ({_iface(self.interface)})")
        p = getattr(obj, "Params", None)
        if p is not None and not (dataclasses.is_dataclass(p) and inspect.isclass(p)):
            raise SpecError(field, f"{ref!r}.Params must be a dataclass (its parameters), got {brief(p)}")

    @staticmethod
    def params(cls: type, data: Mapping[str, Any] | None, field: str) -> Any:
        """``data`` validated into ``cls.Params`` (a frozen dataclass: unknown keys, wrong types and its own
        checks are SpecErrors naming ``field.<key>``); None for a plug-in without parameters."""
        p = getattr(cls, "Params", None)
        if p is None:
            if data:
                raise SpecError(field, f"{cls.__name__} takes no parameters, got {sorted(data)}")
            return None
        if data is not None and not isinstance(data, Mapping):
            raise SpecError(field, f"must be a mapping of {cls.__name__}'s parameters, got {brief(data)}")
        return from_dict(p, dict(data or {}), field)


def _iface(interface: type) -> str:
    return f"{interface.__module__}.{interface.__name__}"


def _import(path: str, field: str, what: str) -> Any:
    mod, colon, attr = path.partition(":")
    if not colon:  # module.path.Class
        mod, _, attr = path.rpartition(".")
    if not (_is_dotted(mod) and attr.isidentifier()):
        raise SpecError(field, f"{path!r} is not a path of the form 'package.module:Class'")
    try:
        module = importlib.import_module(mod)
    except Exception as e:  # noqa: BLE001 - whatever the plug-in's import raises
        raise SpecError(field, f"{what}: module {mod!r} does not import: {type(e).__name__}: {e}") from None
    try:
        return getattr(module, attr)
    except AttributeError:
        raise SpecError(field, f"{what}: module {mod!r} has no {attr!r}") from None
