"""What RLSim can simulate on one machine: a size check that names the field, before any array is allocated;
and the re-sizing of a scenario to a GPU count (``--gpus``, ``--scales``), held to the same rule.

Without it, a scenario that cannot fit (``tors_per_pod: 100000``, ``prompts_per_step: 1000000000``,
``--gpus 1000000000000``) died of MemoryError deep inside numpy. The limits come from measurements
(``/usr/bin/time -f %M orchestrrl sim scenarios/dapo-32b.yaml --fabric F --gpus N``): peak RSS grows with the
square of the cluster, 293 MiB at 16,384 GPUs and 1.0 GB at 32,768 on the Fat-Tree (RFabric: 75 and 125 MiB),
so 65,536 GPUs (~4 GB) is the largest size simulated here. The ToR count bounds the ToR x ToR circuit matrices
(int64: 128 MiB at 4,096 ToRs). The samples per step, which bound the response-length arrays, are checked
when the scenario loads (emulation.workload.MAX_SAMPLES_PER_STEP), for every command.
"""
from __future__ import annotations

import dataclasses

from emulation.scenario import Scenario
from emulation.spec import FabricSpec, JobLayout
from emulation.validation import SpecError, require

MAX_SIM_GPUS = 65536
MAX_SIM_TORS = 4096


def check_gpus(gpus: int | None, field: str = "gpus") -> None:
    """``--gpus``: a positive integer no larger than MAX_SIM_GPUS (checked before the scenario is re-sized)."""
    if gpus is None:
        return
    require(not isinstance(gpus, bool) and isinstance(gpus, int) and gpus >= 1, field,
            f"must be a positive integer, got {gpus!r}")
    require(gpus <= MAX_SIM_GPUS, field, f"{gpus} GPUs; RLSim simulates at most {MAX_SIM_GPUS} on one machine")


def pod_gpus(spec: FabricSpec) -> int:
    return spec.tors_per_pod * spec.servers_per_tor * spec.gpus_per_server


def scale_scenario(scn: Scenario, gpus: int | None) -> Scenario:
    """``scn`` re-sized to ``gpus`` GPUs by its number of pods (layout from the workload's gen_fraction)."""
    if gpus is None or gpus == scn.fabric.n_gpus:
        return scn
    check_gpus(gpus)
    per_pod = pod_gpus(scn.fabric)
    if gpus % per_pod:
        raise SpecError("gpus", f"must be a multiple of the pod size ({per_pod} GPUs: tors_per_pod x "
                                f"servers_per_tor x gpus_per_server), got {gpus}")
    pods = gpus // per_pod
    if pods < 2:
        raise SpecError("gpus", f"needs at least 2 pods (one trains, one generates): >= {2 * per_pod}, got {gpus}")
    n_gen = min(max(1, round(pods * scn.workload.gen_fraction)), pods - 1)
    fabric = dataclasses.replace(scn.fabric, pods=pods, ocs_ports=0)
    layout = JobLayout(train_pods=tuple(range(pods - n_gen)), gen_pods=tuple(range(pods - n_gen, pods)))
    return dataclasses.replace(scn, fabric=fabric, layout=layout)


def _largest(obj: object, prefix: str, names: tuple[str, ...]) -> str:
    """The field (of ``names``) with the largest value: the one to shrink."""
    return f"{prefix}.{max(names, key=lambda n: getattr(obj, n))}"


def check_simulatable(scn: Scenario, gpus: int | None = None) -> None:
    """Raise SpecError naming the field when ``scn`` (re-sized to ``gpus``) is too large to simulate."""
    check_gpus(gpus)
    resized = ""
    if gpus is not None:
        scn = scale_scenario(scn, gpus)
        resized = f" (re-sized to --gpus {gpus})"
    f = scn.fabric
    if f.n_gpus > MAX_SIM_GPUS:
        raise SpecError(_largest(f, "fabric", ("pods", "tors_per_pod", "servers_per_tor", "gpus_per_server")),
                        f"pods x tors_per_pod x servers_per_tor x gpus_per_server = {f.n_gpus} GPUs; RLSim "
                        f"simulates at most {MAX_SIM_GPUS} on one machine")
    if f.n_tors > MAX_SIM_TORS:
        raise SpecError(_largest(f, "fabric", ("pods", "tors_per_pod")),
                        f"pods x tors_per_pod = {f.n_tors} ToRs{resized}; RLSim simulates at most {MAX_SIM_TORS}")
