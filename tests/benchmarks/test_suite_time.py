"""``benchmarks.suite_time`` reads pytest's own output: the summary's counts and the slowest phases of
``--durations``, as a real pytest run in a subprocess prints them."""

from __future__ import annotations

import subprocess
import sys

from benchmarks.suite_time import counts, slowest


def test_counts_and_slowest_tests_from_a_real_pytest_run(tmp_path):
    (tmp_path / "test_probe.py").write_text(
        "import time, pytest\n"
        "def test_quick(): pass\n"
        "def test_slow(): time.sleep(0.3)\n"
        "@pytest.mark.skip(reason='x')\n"
        "def test_skipped(): pass\n"
        "def test_fails(): assert False\n"
    )
    for quiet in (["-q"], []):  # make check's summary line, and make test's between "=" signs
        command = [sys.executable, "-m", "pytest", *quiet, "-p", "no:cacheprovider", "--durations=5", str(tmp_path)]
        result = subprocess.run([*command, "--rootdir", str(tmp_path)], capture_output=True, text=True)
        output = result.stdout + result.stderr
        assert counts(output) == {"passed": 2, "failed": 1, "skipped": 1}
    rows = slowest(output, 2)
    assert rows[0]["test"].endswith("test_probe.py::test_slow") and rows[0]["phase"] == "call"
    assert rows[0]["seconds"] >= 0.3 and len(rows) <= 2
