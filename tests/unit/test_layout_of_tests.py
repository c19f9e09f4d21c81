"""The suite's own layout: pytest imports test modules by basename (rootdir-relative, no packages), so two
test files with one basename in different folders stop collection of the whole suite (`make test`), even
though `make unit` and `make system` each pass alone. CI failed once on tests/unit/test_metrics.py beside
tests/system/test_metrics.py."""
import collections
import pathlib

TESTS = pathlib.Path(__file__).resolve().parents[1]


def test_no_two_test_modules_share_a_basename():
    seen = collections.defaultdict(list)
    for path in TESTS.rglob("test_*.py"):
        seen[path.name].append(str(path.relative_to(TESTS)))
    clashes = {name: paths for name, paths in seen.items() if len(paths) > 1}
    assert not clashes, f"test modules sharing a basename (rename one): {clashes}"
