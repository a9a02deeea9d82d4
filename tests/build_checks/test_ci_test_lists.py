"""The test lists the CI scripts name (.ci/run's SUBSET and SMOKE, .ci/sanitize's files) name tests that exist:
a renamed test or parametrization would otherwise fail CI's later phases after the whole suite passed (pytest
exits 4 on a node id it cannot find)."""

from __future__ import annotations

import pathlib
import re
import subprocess
import sys

REPO = pathlib.Path(__file__).resolve().parents[2]


def listed_tests() -> list[str]:
    """Every test path or node id in the scripts' bash arrays (quoted or bare words starting with tests/)."""
    found = []
    for script in (".ci/run", ".ci/sanitize"):
        text = (REPO / script).read_text()
        for array in re.findall(r"^(?:SUBSET|SMOKE|files)=\((.*?)\)$", text, flags=re.M | re.S):
            found += [q or b for q, b in re.findall(r'"(tests/[^"]+)"|(tests/\S+)', array)]
    return found


def test_the_scripts_list_tests():
    tests = listed_tests()
    assert len(tests) > 30 and any("::" in t and "[" in t for t in tests), tests


def test_every_listed_test_is_collected():
    """Node ids through pytest's own collection (no test runs); files must exist."""
    tests = listed_tests()
    missing = [t for t in tests if not (REPO / t.split("::")[0]).is_file()]
    assert not missing, missing
    ids = sorted({t for t in tests if "::" in t})
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", *ids],
        cwd=REPO,
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    collected = done.stdout
    assert all(i.split("[")[0] in collected for i in ids)
