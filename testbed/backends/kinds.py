"""The built-in backends, registered in testbed.backends.registry.BACKENDS like any plug-in: ``simulated`` (the
engine in virtual time, RLSim's network: every fabric RLSim models) and ``emulated`` (real agents on a Mininet
fabric under the SDN controller: root, the fabrics the emulator builds; cross-checked against ``simulated``)."""
from __future__ import annotations

from emulation.spec import EMULATED_FABRICS, FABRICS

from .registry import BackendKind


class Simulated(BackendKind):
    fabrics = FABRICS

    def backend(self, scenario, layouts, engine, settings, cluster, counterfactual: bool):
        from .simulated import SimulatedBackend

        return SimulatedBackend(scenario, layouts, engine, counterfactual=counterfactual)


class Emulated(BackendKind):
    fabrics = EMULATED_FABRICS
    reference = "simulated"
    has_controller = True

    needs_root = True

    def prepare(self, scenario):
        scenario.fabric.check_emulatable()  # in 0.3 s, before anything starts
        return scenario

    def cluster(self, scenario, layouts, engine):
        from testbed.cluster.agent_pool import running_cluster

        return running_cluster(scenario, layouts=layouts, engine=engine)

    def backend(self, scenario, layouts, engine, settings, cluster, counterfactual: bool):
        from .emulated import EmulatedBackend

        b = EmulatedBackend(scenario, layouts, engine, settings.sync_bucket_mb, cluster=cluster)
        b.prepare(layouts)
        return b
