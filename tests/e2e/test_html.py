"""--qreport-html: a self-contained report of a failing, a passing, an artifact and a block-wise model, written under
-n 2 and opened in headless Chromium, where every chart must draw its traces and the console stay silent."""
import json
import os
import pathlib
import re
import shutil
import subprocess

import pytest

from tests.conftest import NATIVE_CACHE
from tests.forked import run_forked_in
from tests.helpers import FRAGILE_SOURCE, STACK_SOURCE, TINY_SOURCE

pytest.importorskip("jinja2")

ROOT = pathlib.Path(__file__).resolve().parents[2]

REPORT_SOURCE = FRAGILE_SOURCE + TINY_SOURCE.split("from pytest_qreport import qmodel", 1)[1] + \
    f"""
import sys

sys.path.insert(0, {str(ROOT)!r})
""" + '''
from torchao.quantization import Int8DynamicActivationInt8WeightConfig

from tests.helpers import tiny_llama, token_batches, torchao_artifact


''' + STACK_SOURCE + '''


@qmodel(calibration=batches, checks="sqnr,model_sqnr,sensitivity,outlier", fix_budget="unlimited")
def fragile():
    return MLP().eval()


@qmodel(calibration=[torch.randn(16, 8) for _ in range(2)], checks="sqnr,weight_sqnr,model_sqnr,equalization")
def tiny():
    torch.manual_seed(0)
    return Tiny().eval()


@qmodel(calibration=token_batches(2), checks="sqnr,weight_sqnr,model_sqnr,kl_divergence",
        quantized=lambda: torchao_artifact(tiny_llama(), Int8DynamicActivationInt8WeightConfig()))
def llama_int8():
    return tiny_llama()


@qmodel(calibration=[torch.randn(8, 8) for _ in range(2)], blockwise=True, checks="sqnr,weight_sqnr,model_sqnr")
def stack():
    torch.manual_seed(0)
    return Stack().eval()
'''

# what the browser measured of each chart: its traces' drawn boxes (a trace with no points has none)
PROBE = """<script>
window.addEventListener("load", function () {
  var found = Array.from(document.querySelectorAll("svg.chart-svg")).map(function (svg) {
    var boxes = Array.from(svg.querySelectorAll(".trace")).map(function (trace) {
      var box = trace.getBBox(); return [box.width, box.height, trace.childElementCount];
    });
    var title = svg.getAttribute("aria-label"), model = svg.closest("section").querySelector("h2").textContent;
    var frame = svg.getBoundingClientRect();
    var clipped = Array.from(svg.querySelectorAll("text")).filter(function (text) {
      var box = text.getBoundingClientRect();
      return box.left < frame.left - 0.5 || box.bottom > frame.bottom + 0.5 || box.top < frame.top - 0.5;
    }).map(function (text) { return text.textContent; });
    return {model: model, title: title, width: frame.width, traces: boxes, clipped: clipped};
  });
  var out = document.createElement("pre"); out.id = "probe"; out.textContent = JSON.stringify(found);
  document.body.appendChild(out);
});
</script>"""


def _browser():
    return next((path for name in ("chromium", "chromium-browser", "google-chrome")
                 if (path := shutil.which(name))), None)


def _chromium(*args, timeout=120):
    """Headless Chromium, offline, with a profile of its own; (stdout, stderr)."""
    profile = pathlib.Path(os.environ.get("TMPDIR", "/tmp")) / f"qreport-chromium-{os.getpid()}"
    command = [_browser(), "--headless=new", "--no-sandbox", "--disable-gpu", "--hide-scrollbars", "--no-first-run",
               "--disable-background-networking", "--disable-component-update", "--disable-sync",
               f"--user-data-dir={profile}", "--virtual-time-budget=8000", "--host-resolver-rules=MAP * ~NOTFOUND",
               *args]
    done = subprocess.run(command, capture_output=True, text=True, timeout=timeout)
    return done.stdout, done.stderr


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    """One run under -n 2 writing the HTML and JSON reports, shared by the tests below."""
    folder = tmp_path_factory.mktemp("html")
    (folder / "conftest.py").write_text(REPORT_SOURCE)
    path = folder / "report.html"
    result = run_forked_in(folder, "--qreport", "-n", "2", "-p", "no:cacheprovider", f"--qreport-html={path}",
                           f"--qreport-json={folder / 'report.json'}", str(folder),
                           environment={"PYTEST_ADDOPTS": "-p no:hypothesispytest -p no:anyio",
                                        "QCORE_CACHE_DIR": NATIVE_CACHE})
    assert path.exists(), result.stdout.str()[-3000:] + result.stderr.str()[-3000:]
    return path


def test_the_report_is_one_small_offline_file_with_every_row_failures_first(report):
    text = report.read_text()
    assert not re.search(r"<script[^>]+src=|<link[^>]+href=|<img[^>]+src=", text)   # nothing to fetch
    assert len(text.encode()) < 400_000
    rows = json.loads((report.parent / "report.json").read_text())["rows"]
    assert {r["model"] for r in rows} == {"fragile", "tiny", "llama_int8", "stack"}
    assert not [r for r in rows if r["verdict"] == "error"]
    assert text.count('<section class="model"') == 4
    fragile = text[text.index(">fragile</h2>"):text.index("</section>", text.index(">fragile</h2>"))]
    verdicts = re.findall(r'<tr class="row-(\w+)">', fragile)
    assert verdicts[0] == "fail" and verdicts.index("pass") > verdicts.index("warn")   # failures first
    assert "float_layers=[" in fragile and "sensitivity: output SQNR gained" in fragile
    assert re.search(r"layers\.\d: [+-]\d+\.\d\d dB on [12] batch\(es\)", fragile)   # how much each bar measured
    assert "per-layer SQNR in graph order" in fragile and "equalization: SQNR gain per layer of the best method" in text
    assert "&amp;lt;" not in text and "&lt;svg" not in text   # the charts are markup, not escaped text
    llama = text[text.index(">llama_int8</h2>"):text.index("</section>", text.index(">llama_int8</h2>"))]
    # layer names wrap at their dots, never inside a part; the artifact's formats are named; no baseline is claimed
    assert '<td class="layer">model.<wbr>layers.<wbr>0.<wbr>self_<wbr>attn.<wbr>q_<wbr>proj</td>' in llama
    assert "td.layer" not in text.split("td.message { overflow-wrap: anywhere; }")[0].split("<style>")[1]
    formats = {row["details"]["format"] for row in rows if row["model"] == "llama_int8" and row["check"] == "sqnr"}
    assert "<h3>quantized as</h3>" in llama and all(f"<dt>{name}</dt>" in llama for name in formats), formats
    assert "<dt>baseline</dt><dd>none (--qreport-update-baseline writes " in llama
    assert oct(report.stat().st_mode & 0o777) != "0o600"   # an ordinary file, written atomically


def test_every_chart_draws_its_traces_in_headless_chromium_without_console_errors(report, tmp_path):
    assert _browser() is not None, "no Chromium: apt-get install chromium (.ci/run installs it)"
    _, log = _chromium("--enable-logging=stderr", "--v=0", "--dump-dom", report.as_uri())
    console = [line for line in log.splitlines() if ":CONSOLE" in line]
    assert not console, console
    probed = tmp_path / "probed.html"   # the same page with a script that reads what the browser drew
    probed.write_text(report.read_text().replace("</body>", PROBE + "</body>"))
    dom, log = _chromium("--enable-logging=stderr", "--v=0", "--dump-dom", probed.as_uri())
    assert not [line for line in log.splitlines() if ":CONSOLE" in line]
    charts = json.loads(re.search(r'<pre id="probe">(.*?)</pre>', dom, re.S).group(1).replace("&quot;", '"'))
    per_model = {}
    for chart in charts:
        per_model.setdefault(chart["model"], []).append(chart["title"])
        assert chart["width"] > 400 and chart["traces"], chart
        assert not chart["clipped"], chart  # every label inside its chart, the rotated layer names too
        assert all(width > 0 and height >= 0 for width, height, _ in chart["traces"]), chart
    assert set(per_model) == {"fragile", "tiny", "llama_int8", "stack"}   # the artifact and block-wise ones too
    assert any(title.startswith("sensitivity") for title in per_model["fragile"])
    screenshot = tmp_path / "report.png"
    _chromium("--window-size=1280,2000", f"--screenshot={screenshot}", report.as_uri())
    assert screenshot.exists() and screenshot.stat().st_size > 20_000
    keep = os.environ.get("QREPORT_SCREENSHOT_DIR")
    if keep:
        shutil.copy(screenshot, keep)


def test_a_missing_html_extra_is_one_line_naming_it(pytester):
    pytester.makeconftest("import sys\nsys.modules['jinja2'] = None\n" + TINY_SOURCE)
    result = pytester.runpytest("--qreport", "--qreport-html=out.html")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    assert "ERROR: qreport: --qreport-html needs the html extra (jinja2 is missing): pip install " \
           "'pytest-qreport[html]'" in result.stderr.str()
    assert not (pytester.path / "out.html").exists()
