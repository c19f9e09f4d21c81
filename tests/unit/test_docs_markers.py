"""No merge-conflict markers left in the docs or the README (a stash pop once left one in docs/orchestrator.md)."""
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[2]
MARKER = re.compile(r"^(<{7} |={7}$|>{7} )", re.M)


def test_no_conflict_markers_in_docs():
    files = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    bad = [str(f.relative_to(ROOT)) for f in files if MARKER.search(f.read_text(encoding="utf-8"))]
    assert not bad, f"merge-conflict markers in {bad}"
