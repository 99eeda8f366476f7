"""Size and load time of the --qreport-html report: the examples' five models, and a 300-layer model.

Runs `pytest --qreport --qreport-html` on examples/ and on a 300-Linear MLP (seeded weights), then loads the
300-layer report in headless Chromium (Debian's `chromium`) and reports the time to a rendered DOM, minus the
time to load an empty page (the browser's own start-up).

    python benchmarks/bench_html.py
"""
from __future__ import annotations

import pathlib
import shutil
import subprocess
import sys
import tempfile
import time

CONFTEST = '''
import torch
from torch import nn
from pytest_qreport import qmodel


@qmodel(calibration=[torch.randn(32, 16, generator=torch.Generator().manual_seed(i)) for i in range(2)],
        checks="sqnr,weight_sqnr,model_sqnr,outlier", check_options={"sensitivity": {"always": True}})
def deep_mlp():
    torch.manual_seed(0)
    return nn.Sequential(*[module for _ in range(300) for module in (nn.Linear(16, 16), nn.ReLU())]).eval()
'''


def _load_seconds(browser: str, url: str) -> float:
    start = time.perf_counter()
    subprocess.run([browser, "--headless=new", "--no-sandbox", "--disable-gpu", "--dump-dom", "--no-first-run",
                    "--disable-background-networking", "--disable-component-update", "--disable-sync",
                    "--virtual-time-budget=8000", url], capture_output=True, timeout=300, check=True)
    return time.perf_counter() - start


def _examples_report(folder: pathlib.Path) -> None:
    report = folder / "examples.html"
    root = pathlib.Path(__file__).resolve().parents[1]
    subprocess.run([sys.executable, "-m", "pytest", "--qreport", "-q", "-p", "no:cacheprovider",
                    f"--qreport-html={report}", "examples/"], cwd=root, capture_output=True, timeout=900)
    text = report.read_text()
    print(f"examples/ (5 models): {text.count('<tr class=')} rows, {text.count('<svg class=')} charts, report "
          f"{report.stat().st_size / 1e6:.3f} MB")


def main() -> None:
    folder = pathlib.Path(tempfile.mkdtemp())
    _examples_report(folder)
    (folder / "conftest.py").write_text(CONFTEST)
    report = folder / "report.html"
    start = time.perf_counter()
    subprocess.run([sys.executable, "-m", "pytest", "--qreport", "-q", "-p", "no:cacheprovider",
                    f"--qreport-html={report}", str(folder)], cwd=folder, capture_output=True, timeout=900)
    run = time.perf_counter() - start
    text = report.read_text()
    print(f"300-layer MLP: {text.count('<tr class=')} rows, report {report.stat().st_size / 1e6:.3f} MB; "
          f"pytest run {run:.1f} s")
    browser = next((shutil.which(n) for n in ("chromium", "chromium-browser", "google-chrome") if shutil.which(n)),
                   None)
    if browser is None:
        print("no Chromium: apt-get install chromium to time the page load")
        return
    empty = folder / "empty.html"
    empty.write_text("<html><body></body></html>")
    blank = min(_load_seconds(browser, empty.as_uri()) for _ in range(3))
    loaded = min(_load_seconds(browser, report.as_uri()) for _ in range(3))
    print(f"headless Chromium: {loaded:.2f} s to a rendered DOM, {loaded - blank:.2f} s more than an empty page")


if __name__ == "__main__":
    main()
