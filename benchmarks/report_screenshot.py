"""Open a ``vit-ct report`` page in headless Chromium (the distribution's ``chromium`` and ``chromium-driver``), check
that it loads without a console error or a broken figure, and save its first screen as a PNG: the README's picture
of the demo's report.

    make demo && vit-ct report outputs/demo --manifest data/synthetic/manifest.csv
    python -m benchmarks.report_screenshot outputs/demo/report/report.html --output docs/report.png

It exits 1, writing no picture, when the page logs an error or a figure does not decode.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
from pathlib import Path

WIDTH, HEIGHT = 1200, 900  # the first screen of a laptop, CSS pixels

# Every <img> decoded (a broken data URI has naturalWidth 0), the headings a reader scans, the page's title.
PAGE_STATE = """
const images = Array.from(document.images);
return {
  title: document.title,
  headings: Array.from(document.querySelectorAll('h1, h2')).map(h => h.textContent.trim()),
  images: images.length,
  broken: images.filter(img => !img.complete || img.naturalWidth === 0).map(img => img.alt),
};
"""


def chromium_driver(profile: Path, *, width: int = WIDTH, height: int = HEIGHT):
    """Headless Chromium through its own chromedriver, logging the page's console."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    chromium, chromedriver = shutil.which("chromium"), shutil.which("chromedriver")
    if chromium is None or chromedriver is None:
        raise FileNotFoundError("chromium and chromedriver not on PATH (Debian/Ubuntu: apt-get install chromium"
                                " chromium-driver)")  # fmt: skip
    options = webdriver.ChromeOptions()
    options.binary_location = chromium
    for flag in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", f"--window-size={width},{height}",
                 "--hide-scrollbars", f"--user-data-dir={profile}"):  # fmt: skip
        options.add_argument(flag)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(service=Service(chromedriver), options=options)
    # --window-size counts the window's frame: the viewport itself, at one device pixel per CSS pixel, is set here
    metrics = {"width": width, "height": height, "deviceScaleFactor": 1, "mobile": False}
    driver.execute_cdp_cmd("Emulation.setDeviceMetricsOverride", metrics)
    return driver


def open_report(driver, page: Path) -> dict:
    """Load ``page`` and return its state: ``title``, ``headings``, ``images``, ``broken`` (alt texts of figures that
    did not decode) and ``errors`` (the console's SEVERE entries)."""
    driver.get(Path(page).resolve().as_uri())
    state = driver.execute_script(PAGE_STATE)
    state["errors"] = [entry["message"] for entry in driver.get_log("browser") if entry["level"] == "SEVERE"]
    return state


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("page", help="a report.html written by vit-ct report")
    parser.add_argument("--output", default="docs/report.png", help="the PNG of the first screen (docs/report.png)")
    parser.add_argument("--width", type=int, default=WIDTH, help=f"window width, CSS pixels (default {WIDTH})")
    parser.add_argument("--height", type=int, default=HEIGHT, help=f"window height, CSS pixels (default {HEIGHT})")
    args = parser.parse_args(argv)
    page = Path(args.page)
    if not page.is_file():
        parser.exit(2, f"report_screenshot: {page} is not a file; expected a report.html written by vit-ct report\n")
    with tempfile.TemporaryDirectory() as profile:
        driver = chromium_driver(Path(profile), width=args.width, height=args.height)
        try:
            state = open_report(driver, page)
            if state["errors"] or state["broken"]:
                print(f"report_screenshot: {page}: console errors {state['errors']}, figures that did not decode "
                      f"{state['broken']}; no picture written", file=sys.stderr)  # fmt: skip
                raise SystemExit(1)
            output = Path(args.output)
            output.parent.mkdir(parents=True, exist_ok=True)
            png = driver.get_screenshot_as_png()
        finally:
            driver.quit()
    from vit_ct.files import atomic_write

    with atomic_write(output) as tmp:
        tmp.write_bytes(png)
    print(f"{page}: {state['images']} figures, no console error; first screen ({args.width} x {args.height}) in "
          f"{output}")  # fmt: skip
    return state


if __name__ == "__main__":
    main()
