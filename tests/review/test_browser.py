"""The review notebook in a real browser: JupyterLab serves it, headless Chromium (the distribution's ``chromium`` and
``chromium-driver``) runs every cell, the scan view's widgets draw, and a click on a verdict button reaches the
verdicts CSV and the summary of the verdicts below. The papermill run (tests/review/test_notebook.py) covers the
headless path; this covers the one users see."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import pytest
from conftest import TINY_MODEL_ARGS, free_port, run_vit_ct, tiny_data_args
from PIL import Image

from vit_ct import review
from vit_ct.review import notebook as review_notebook
from vit_ct.review.scan_view import scans_by_probability

ROOT = Path(__file__).resolve().parents[2]
CHROMIUM, CHROMEDRIVER = shutil.which("chromium"), shutil.which("chromedriver")
TOKEN = "vit-ct-browser-test"
REVIEWER = "reader-1"

# CI must run this test, not skip it: there (CI set, as CI services and .ci/run do) a missing browser fails it.
IN_CI = os.environ.get("CI", "").strip().lower() not in ("", "0", "false", "no")
MISSING = [name for name, path in (("chromium", CHROMIUM), ("chromedriver", CHROMEDRIVER)) if path is None]
INSTALL = "Debian/Ubuntu: apt-get install chromium chromium-driver"

pytestmark = [pytest.mark.slow]
if MISSING and not IN_CI:
    pytestmark.append(pytest.mark.skip(reason=f"needs {' and '.join(MISSING)} on PATH ({INSTALL}); CI fails instead"))


@pytest.fixture(autouse=True)
def browser_installed():
    """Under CI, a missing browser fails the test before its minutes of set-up (elsewhere it is skipped)."""
    if MISSING:
        pytest.fail(
            f"CI={os.environ.get('CI')} and {' and '.join(MISSING)} not on PATH: CI must run the browser test; install"
            f" them ({INSTALL}; .ci/run does), or unset CI to skip it",
            pytrace=False,
        )


def _wait_for(condition, timeout: float, what: str, poll: float = 0.5):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(poll)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what} (last: {value!r})")


@pytest.fixture
def lab(synthetic_set, tmp_path):
    """A trained tiny checkpoint, its ``vit-ct predict`` output, the review notebook with its parameters set, and
    JupyterLab serving that folder with a kernel of this interpreter. Yields (url, folder)."""
    import papermill

    demo = str(ROOT / "configs" / "demo.yaml")
    data = tiny_data_args(synthetic_set)
    run_vit_ct("fit", "--config", demo, *data, *TINY_MODEL_ARGS, "--trainer.max_epochs", "1", "--test_after_fit",
            "false", cwd=tmp_path)  # fmt: skip
    best = json.loads((tmp_path / "runs" / "latest" / "summary.json").read_text())["best_checkpoint"]
    run_vit_ct("predict", "--config", demo, *data, "--ckpt_path", best, "--data.init_args.predict_split", "test",
            "--output_dir", "outputs/demo", cwd=tmp_path)  # fmt: skip
    parameters = {"manifest": str(synthetic_set), "n_cases": 1, "predict_output": "outputs/demo",
                  "reviewer": REVIEWER, "interactive": True}  # fmt: skip
    papermill.execute_notebook(str(review_notebook.NOTEBOOK), str(tmp_path / "review.ipynb"),
                               parameters=parameters, prepare_only=True, progress_bar=False)  # fmt: skip

    port = free_port()
    log = (tmp_path / "jupyter.log").open("w")
    with review_notebook._this_python_kernel():  # JUPYTER_PATH: the server's python3 kernel is this interpreter
        env = {**os.environ, "WANDB_MODE": "offline", "JUPYTER_CONFIG_DIR": str(tmp_path / ".jupyter")}
        server = subprocess.Popen(
            [sys.executable, "-m", "jupyter", "lab", "--no-browser", f"--ServerApp.port={port}",
             "--ServerApp.ip=127.0.0.1", f"--IdentityProvider.token={TOKEN}", f"--ServerApp.root_dir={tmp_path}",
             "--LabApp.expose_app_in_browser=True", "--LabApp.extension_manager=readonly", "--allow-root"],
            cwd=tmp_path, env=env, stdout=log, stderr=subprocess.STDOUT,
        )  # fmt: skip
    try:
        url = f"http://127.0.0.1:{port}"
        _wait_for(lambda: _answers(url) or server.poll() is not None, 120, "JupyterLab to answer")
        assert server.poll() is None, f"JupyterLab exited: {(tmp_path / 'jupyter.log').read_text()[-3000:]}"
        yield url, tmp_path
    finally:
        server.terminate()
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            server.kill()
        log.close()


def _answers(url: str) -> bool:
    import urllib.request

    try:
        with urllib.request.urlopen(f"{url}/api/status?token={TOKEN}", timeout=5) as response:
            return response.status == 200
    except OSError:
        return False


@pytest.fixture
def chromium(tmp_path):
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--window-size=1400,2400",
                 f"--user-data-dir={tmp_path / 'chromium-profile'}"):  # fmt: skip
        options.add_argument(flag)
    browser = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
    try:
        yield browser
    finally:
        browser.quit()


def test_the_scan_view_draws_in_jupyterlab_and_a_verdict_click_reaches_the_csv_and_the_summary(lab, chromium):
    from selenium.webdriver.common.by import By

    url, folder = lab
    chromium.get(f"{url}/lab/tree/review.ipynb?token={TOKEN}")
    # The notebook's panel, its kernel connected and idle; a click into it (a headless window gets no focus event, and
    # JupyterLab's commands act on the focused notebook), then "Run All Cells", as from the Run menu.
    state = """const app = window.jupyterapp;
        const panel = app && [...app.shell.widgets('main')].find(w => w.context && w.context.path === 'review.ipynb');
        return panel ? [panel.sessionContext.kernelDisplayStatus, app.shell.currentWidget === panel] : 'no notebook';"""
    try:
        _wait_for(lambda: chromium.execute_script(state)[0] == "idle", 180, "the notebook's kernel to be idle")
        chromium.find_elements(By.CSS_SELECTOR, ".jp-Notebook .jp-Cell")[0].click()
        _wait_for(lambda: chromium.execute_script(state)[1], 30, "the notebook to have the focus")
        chromium.execute_script("window.jupyterapp.commands.execute('notebook:run-all-cells')")

        def verdict_button():
            buttons = chromium.find_elements(By.CSS_SELECTOR, ".widget-toggle-buttons button")
            return next((b for b in buttons if b.text.strip() == "on the lesion" and b.is_displayed()), None)

        button = _wait_for(verdict_button, 480, "the scan view's verdict buttons", poll=2)
        # The widgets drew: the scan dropdown, the slice slider, and the scan's figure inside the Output widget.
        assert chromium.find_elements(By.CSS_SELECTOR, ".widget-dropdown select")
        assert chromium.find_elements(By.CSS_SELECTOR, ".widget-slider, .jupyter-widgets.widget-hslider")
        figure = "return [...document.querySelectorAll('.widget-output img')].some(i => i.naturalWidth > 100)"
        _wait_for(lambda: chromium.execute_script(figure), 120, "the scan's figure in the Output widget")
        errors = chromium.find_elements(By.CSS_SELECTOR, ".jp-OutputArea-output[data-mime-type*='error']")
        assert not errors, errors[0].text[:2000]

        # The verdicts so far, drawn by the cell below the scan view before any click: no case yet.
        cases = """const row = [...document.querySelectorAll('.widget-html table tr')]
            .find(r => r.querySelector('th') && r.querySelector('th').textContent.trim() === 'cases');
            return row ? row.querySelector('td').textContent.trim() : null;"""
        _wait_for(lambda: chromium.execute_script(cases), 120, "the verdicts summary below the scan view")
        assert chromium.execute_script(cases) == "0"
        scan = scans_by_probability(review.open_predict_run(folder / "outputs" / "demo"))[0]  # the view's first
        button.click()
        verdicts = review.verdicts_path(folder / "outputs" / "review", REVIEWER)

        def recorded():
            if not verdicts.is_file():
                return None
            rows = pd.read_csv(verdicts).set_index("case")
            return scan in rows.index and rows.loc[scan, "map"] == "on the lesion"

        _wait_for(recorded, 60, f"the click's verdict on {scan} in {verdicts}")
        assert pd.read_csv(verdicts)["reviewer"].eq(REVIEWER).all()
        _wait_for(lambda: chromium.execute_script(cases) == "1", 30, "the verdicts summary to count the click")
    except BaseException:
        chromium.save_screenshot(str(folder / "browser.png"))
        print(f"screenshot: {folder / 'browser.png'}; server log: {folder / 'jupyter.log'}")
        raise


def test_the_report_opens_without_errors_and_its_first_screen_is_captured(tmp_path):
    """``vit-ct report``'s page in headless Chromium: every figure decodes, the console logs no error, and the README's
    picture script captures the first screen; a page with a broken figure is refused and leaves no picture."""
    from predict_outputs import fake_predict_output

    from vit_ct.report.report_files import write_report

    out, manifest = fake_predict_output(tmp_path)
    page = write_report(out, manifest, tmp_path / "report", resamples=50)
    from benchmarks import report_screenshot as screenshot

    png = tmp_path / "first_screen.png"
    state = screenshot.main([str(page), "--output", str(png), "--width", "1000", "--height", "700"])
    assert state["errors"] == [] and state["broken"] == []
    assert state["images"] >= 4 and {"Detection", "Calibration"} <= set(state["headings"])
    with Image.open(png) as picture:
        assert picture.size == (1000, 700)

    broken = tmp_path / "broken.html"
    broken.write_text(page.read_text().replace("data:image/png;base64,", "data:image/png;base64,AAAA", 1))
    with pytest.raises(SystemExit) as exit_info:
        screenshot.main([str(broken), "--output", str(tmp_path / "none.png")])
    assert exit_info.value.code == 1 and not (tmp_path / "none.png").exists()


def test_the_report_does_not_scroll_sideways_at_1280_px(tmp_path, chromium):
    """Long subgroup levels and many columns stay inside a 1280-pixel window."""
    from predict_outputs import fake_predict_output

    from vit_ct.report.report_files import write_report

    out, manifest = fake_predict_output(tmp_path)
    table = pd.read_csv(manifest)
    # a level with no space to break at, as a site's protocol code or a pasted UID has it
    table["protocol"] = [f"1.2.826.0.1.3680043.8.498.{i % 3}" + "7" * 90 for i in range(len(table))]
    table.to_csv(manifest, index=False)
    page = write_report(out, manifest, tmp_path / "report", resamples=20)
    chromium.set_window_size(1280, 900)
    chromium.get(page.as_uri())
    width, window = chromium.execute_script("return [document.documentElement.scrollWidth, window.innerWidth]")
    assert width <= window, (width, window)
