"""--qreport-html: a self-contained report, written under -n 2, opened in headless Chromium (issue: sensitivity)."""
import os
import re
import shutil
import subprocess

import pytest

from tests.helpers import FRAGILE_SOURCE, TINY_SOURCE

pytest.importorskip("jinja2")
pytest.importorskip("plotly")

REPORT_SOURCE = FRAGILE_SOURCE + TINY_SOURCE.split("from pytest_qreport import qmodel", 1)[1] + '''


@qmodel(calibration=batches, checks="sqnr,model_sqnr,sensitivity,outlier")
def fragile():
    return MLP().eval()


@qmodel(calibration=[torch.randn(16, 8) for _ in range(2)], checks="sqnr,weight_sqnr,model_sqnr,equalization")
def tiny():
    torch.manual_seed(0)
    return Tiny().eval()
'''


def _browser():
    return next((path for name in ("chromium", "chromium-browser", "google-chrome")
                 if (path := shutil.which(name))), None)


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    """One run under -n 2 writing the HTML report, shared by the tests below."""
    folder = tmp_path_factory.mktemp("html")
    (folder / "conftest.py").write_text(REPORT_SOURCE)
    path = folder / "report.html"
    result = subprocess.run([os.sys.executable, "-m", "pytest", "--qreport", "-n", "2", "-p", "no:cacheprovider",
                             f"--qreport-html={path}", str(folder)], capture_output=True, text=True, cwd=folder,
                            timeout=300)
    assert path.exists(), result.stdout[-3000:] + result.stderr[-3000:]
    return path


def test_the_report_is_one_offline_file_with_every_row_failures_first(report):
    text = report.read_text()
    assert not re.search(r"<script[^>]+src=|<link[^>]+href=|<img[^>]+src=", text)   # nothing to fetch
    assert "Plotly.newPlot" in text and text.count("<section class=\"model\"") == 2
    fragile = text[text.index(">fragile</h2>"):text.index(">tiny</h2>")]
    verdicts = re.findall(r'<tr class="row-(\w+)">', fragile)
    assert verdicts[0] == "fail" and verdicts.index("pass") > verdicts.index("warn")   # failures first
    assert "float_layers=[" in fragile and "sensitivity: output SQNR gained" in fragile
    assert "per-layer SQNR in graph order" in fragile and "equalization: SQNR gain per layer of the best method" in text
    assert oct(report.stat().st_mode & 0o777) != "0o600"   # an ordinary file, written atomically


@pytest.mark.skipif(_browser() is None, reason="no Chromium: apt-get install chromium (see the README)")
def test_the_report_loads_in_headless_chromium_without_console_errors(report, tmp_path):
    browser = [_browser(), "--headless=new", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
               "--virtual-time-budget=8000", "--host-resolver-rules=MAP * ~NOTFOUND"]   # offline
    loaded = subprocess.run(browser + ["--enable-logging=stderr", "--v=0", "--dump-dom", report.as_uri()],
                            capture_output=True, text=True, timeout=120)
    console = [line for line in loaded.stderr.splitlines() if ":CONSOLE" in line]
    assert not console, console
    dom = loaded.stdout
    assert dom.count('class="main-svg"') >= 4             # Plotly drew the charts (each draws a few layers)
    assert 'class="row-fail"' in dom and "fragile" in dom
    screenshot = tmp_path / "report.png"
    subprocess.run(browser + ["--window-size=1400,2000", f"--screenshot={screenshot}", report.as_uri()],
                   capture_output=True, text=True, timeout=120)
    assert screenshot.exists() and screenshot.stat().st_size > 20_000
    keep = os.environ.get("QREPORT_SCREENSHOT_DIR")
    if keep:
        shutil.copy(screenshot, keep)


def test_a_missing_html_extra_is_one_line_naming_it(pytester):
    pytester.makeconftest("import sys\nsys.modules['plotly'] = None\n" + TINY_SOURCE)
    result = pytester.runpytest("--qreport", "--qreport-html=out.html")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    assert "ERROR: qreport: --qreport-html needs the html extra (plotly is missing): pip install " \
           "'pytest-qreport[html]'" in result.stderr.str()
    assert not (pytester.path / "out.html").exists()
