"""Every benchmark of the testbed (they print JSON figures; they never assert). bench_fabric, bench_agents,
bench_faults and bench_orchestrator run under `orchestrrl bench ...`; the others are scripts
(`.venv/bin/python testbed/benchmarks/bench_NAME.py`, usage in each docstring)."""
