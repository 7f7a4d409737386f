"""`psld bench run --suite python`: register + push_pull from Python against
the same from C++, as rows psld bench compare reads. It measures nothing
(docs/perf-ci.md); it checks that the suite runs and its rows carry ratios."""

import json
import subprocess
from pathlib import Path

import pytest

from conftest import psld_command

REPO = Path(__file__).resolve().parents[2]
BENCH = REPO / "build" / "bench"


@pytest.mark.skipif(not (BENCH / "register_push_pull").is_file(),
                    reason=f"no {BENCH}/register_push_pull: build/ with -Dbench=true (tools/dev build)")
def test_python_suite_rows_have_ratios_against_cxx(tmp_path):
    report = tmp_path / "python.json"
    run = subprocess.run([psld_command(), "bench", "run", "--suite", "python", "--size", "quick",
                          "--repetitions", "1", "--bench-dir", str(BENCH), "--json", str(report)],
                         capture_output=True, text=True, timeout=100)
    assert run.returncode == 0, run.stdout + run.stderr
    rows = {b["name"]: b for b in json.loads(report.read_text())["benchmarks"]
            if b["run_type"] == "iteration"}
    for step in ("register_s", "push_pull_s", "second_push_pull_s", "register_push_pull"):
        row = rows[f"python/BM_python_{step}"]
        assert row["yardstick"] == f"python/BM_cxx_{step}"
        assert row["ratio"] > 0
        assert rows[f"python/BM_cxx_{step}"]["real_time"] > 0
