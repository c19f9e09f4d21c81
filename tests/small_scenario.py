"""The small scenario the driver's tests run: 2 pods x 1 ToR x 2 servers (trainers 0 and 1, generators 2 and
3), 12 prompts x 8 samples of a 7B model with responses of median 150 tokens, an engine of 8 sequences and a
planning interval of 0.5 s: seconds a step on either backend. Tests that need something else pass it.
"""
from __future__ import annotations

from emulation.orchestration import orchestrator_settings
from emulation.scenario import ControllerSettings, Scenario
from emulation.spec import FabricSpec, JobLayout
from emulation.workload import WorkloadSpec


def small_scenario(name: str, *, seed: int = 5, steps: int = 1, max_response_tokens: int = 600,
                   orchestrator: dict | None = None) -> Scenario:
    """The small scenario; ``orchestrator`` adds to (and overrides) its orchestrator section."""
    return Scenario(
        name=name, seed=seed,
        fabric=FabricSpec(pods=2, tors_per_pod=1, servers_per_tor=2, ocs_count=1, uplinks_per_tor=2),
        layout=JobLayout((0,), (1,)),
        workload=WorkloadSpec(model="Qwen2.5-7B", prompts_per_step=12, samples_per_prompt=8,
                              response_median_tokens=150, response_sigma=0.8, prompt_sigma=0.4,
                              max_response_tokens=max_response_tokens, steps=steps),
        controller=ControllerSettings(initial_phase="train"),
        orchestrator=orchestrator_settings({"planning_interval_s": 0.5, "engine": {"max_num_seqs": 8},
                                            **(orchestrator or {})}))
