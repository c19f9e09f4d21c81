"""The backends as a registry (emulation.plugins.Registry): what a comparison needs to know of a backend, behind
one interface (:class:`BackendKind`), so that no command, run or comparison compares a backend's name.
Built-ins: ``simulated`` and ``emulated`` (testbed.backends.kinds); a user's by ``--backend pkg.mod:Class``
or an entry point in group ``orchestrrl.backends``."""
from __future__ import annotations

import abc
import contextlib

from emulation.plugins import Registry


class BackendKind(abc.ABC):
    """A kind of backend. ``fabrics``: the fabric kinds it runs; ``reference``: the backend its runs are
    cross-checked against (``compare --fabric``; None: none); ``has_controller``: it runs the SDN controller
    (whose metrics endpoint a run prints); ``needs_root``: it builds a fabric."""

    fabrics: tuple[str, ...] = ()
    reference: str | None = None
    has_controller: bool = False
    needs_root: bool = False

    def prepare(self, scenario):
        """Checks of the scenario before anything starts (SpecError: exit 2); the scenario to run."""
        return scenario

    def cluster(self, scenario, layouts: dict, engine):
        """What serves every policy of a comparison (started once; a context manager), or None."""
        return contextlib.nullcontext()

    @abc.abstractmethod
    def backend(self, scenario, layouts: dict, engine, settings, cluster, counterfactual: bool):
        """A testbed.backends.base.Backend for one run: the generators in ``layouts``, ``engine`` settings;
        ``counterfactual``: report what each migration really gained, where the backend can tell."""


BACKENDS = Registry("backend", BackendKind, "backends", {
    "emulated": "testbed.backends.kinds:Emulated",
    "simulated": "testbed.backends.kinds:Simulated",
})


def backend_kind(ref: str, field: str = "backend") -> BackendKind:
    """The backend ``ref`` names, made (SpecError naming ``field`` for an unknown one)."""
    return BACKENDS.resolve(ref, field)()
