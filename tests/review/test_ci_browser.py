"""CI cannot pass without the review notebook's browser test: where ``CI`` is set (CI services set ``CI=true``;
``.ci/run`` sets it too), a missing Chromium or ChromeDriver fails tests/review/test_browser.py, saying what to install;
elsewhere the test is skipped, saying why."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

BROWSER = Path(__file__).resolve().with_name("test_browser.py")
BROWSER_TESTS = BROWSER.read_text().count("\ndef test_")  # the notebook's, the report's


@pytest.mark.slow  # two pytest runs that import the review notebook's modules
@pytest.mark.parametrize("ci", ["true", ""], ids=["CI=true", "CI unset"])
def test_a_missing_browser_fails_the_browser_test_under_ci_and_skips_it_elsewhere(tmp_path, ci):
    env = {**os.environ, "CI": ci, "PATH": str(tmp_path)}  # a PATH without chromium and chromedriver
    command = [sys.executable, "-m", "pytest", str(BROWSER), "-q", "-p", "no:cacheprovider"]
    run = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    if ci:
        assert run.returncode == 1, run.stdout[-3000:]
        assert (
            "CI=true and chromium and chromedriver not on PATH: CI must run the browser test; install them"
            " (Debian/Ubuntu: apt-get install chromium chromium-driver; .ci/run does), or unset CI to skip it"
        ) in run.stdout, run.stdout[-3000:]
        # every test failed in its set-up, before the minutes the lab fixture takes
        assert f"{BROWSER_TESTS} error" in run.stdout and "passed" not in run.stdout, run.stdout[-3000:]
    else:
        assert run.returncode == 0, run.stdout[-3000:]
        assert "needs chromium and chromedriver on PATH (Debian/Ubuntu: apt-get install chromium" in run.stdout
        assert f"{BROWSER_TESTS} skipped" in run.stdout
