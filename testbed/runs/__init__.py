"""Runs and comparisons of policies: experiment.py (run, compare), tuning.py (the tuned static baseline),
oracle.py (the oracle bounds), policymap.py (`orchestrrl map`), fabric_compare.py (the same steps on several
fabrics), report.py (JSON, trace, plots), metrics.py (the driver's live metrics)."""
