"""The decision path decides as it did before it was optimised: every case of orchestrator_cases.py (bench-like
ticks at 1,024 requests, mixed layouts, switches in progress and cooling down, arrivals, draining tails where
the lookahead runs, hot replicas and cross-server moves, exact lengths) gives the planner's decisions (reasons
included), the balancer's moves and load indices, and the estimator's schedules, placements, stratified
lengths, progress and advanced loads of the pinned file, written by the implementation of commit d7f5f6f:
strings, flags and integers equal, every float within 1e-9 relative."""
import json
import math
import os

import pytest

from orchestrator_cases import cases

PINNED = os.path.join(os.path.dirname(__file__), "data", "orchestrator_pinned.json")
REL = 1e-9


def _same(got, want, path, diffs):
    if isinstance(want, dict):
        if not isinstance(got, dict) or set(got) != set(want):
            diffs.append(f"{path}: keys {sorted(got) if isinstance(got, dict) else got!r} != {sorted(want)}")
            return
        for k in want:
            _same(got[k], want[k], f"{path}/{k}", diffs)
    elif isinstance(want, list):
        if not isinstance(got, list) or len(got) != len(want):
            diffs.append(f"{path}: length {len(got) if isinstance(got, list) else got!r} != {len(want)}")
            return
        for i, (g, w) in enumerate(zip(got, want)):
            _same(g, w, f"{path}[{i}]", diffs)
    elif isinstance(want, float) and not isinstance(got, bool) and isinstance(got, (int, float)):
        if not (got == want or math.isclose(got, want, rel_tol=REL, abs_tol=1e-12)):
            diffs.append(f"{path}: {got!r} != {want!r}")
    elif got != want or type(got) is not type(want):
        diffs.append(f"{path}: {got!r} != {want!r}")


with open(PINNED) as f:
    WANT = json.load(f)


@pytest.mark.parametrize("name, go", cases(), ids=[n for n, _ in cases()])
def test_decision_path_matches_the_pinned_results(name, go):
    got = json.loads(json.dumps(go()))  # the same JSON types as the pinned file
    diffs = []
    _same(got, WANT[name], name, diffs)
    assert not diffs, f"{len(diffs)} differences, first: " + "; ".join(diffs[:5])


def test_every_pinned_case_is_run():
    assert set(WANT) == {n for n, _ in cases()}
