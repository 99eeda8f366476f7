"""The README's set-up commands are the ones CI runs."""
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _readme_commands():
    return re.findall(r"```bash\n(python3 -m venv .*)\n```", (ROOT / "README.md").read_text())


def test_ci_runs_the_readme_test_command():
    commands = _readme_commands()
    assert len(commands) == 2
    ci = (ROOT / ".ci" / "run").read_text().strip().splitlines()[-1]
    assert ci == commands[1] and commands[1].endswith("pytest -n 2 tests/")
    assert commands[0].endswith("pytest --qreport examples/")


def test_the_getting_started_page_gives_the_readmes_commands_and_output():
    """The guide's first page installs what the README installs and shows the run it shows."""
    readme, page = (ROOT / "README.md").read_text(), (ROOT / "docs" / "getting-started.md").read_text()
    assert re.findall(r"```bash\n(python3 -m venv .*)\n```", page) == _readme_commands()
    sample = re.compile(r"```\n\$ pytest --qreport -v\n.*?```\n\n\(Times from .*?\)\n", re.S)
    assert sample.search(page).group(0) == sample.search(readme).group(0)


def test_the_options_page_is_generated_from_the_settings_schema():
    import importlib.util

    from pytest_qreport.checks import BUILTIN_CHECKS
    from pytest_qreport.core.settings import options_table

    spec = importlib.util.spec_from_file_location("docs_hooks", ROOT / "docs" / "hooks.py")
    hooks = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(hooks)
    page = (ROOT / "docs" / "reference" / "options.md").read_text()
    assert options_table(BUILTIN_CHECKS) in hooks.options_page_markdown(page)


def test_the_readme_is_short_and_points_to_the_documentation():
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= 300
    for link in re.findall(r"\]\((docs/[^)#]+)", text):
        assert (ROOT / link).exists(), link


def test_every_setting_is_an_option_an_ini_key_and_a_qmodel_keyword_where_declared(pytester):
    from pytest_qreport.checks import BUILTIN_CHECKS
    from pytest_qreport.core.settings import SESSION_SETTINGS, model_schema

    pytester.makeini("[pytest]\n")
    config = pytester.parseconfig("--qreport-cosine-min", "0.5")
    assert config.getoption("qreport_cosine_min") == "0.5"
    for setting in (*model_schema(BUILTIN_CHECKS).values(), *SESSION_SETTINGS):
        if setting.flag:
            config.getoption(setting.dest)  # registered: no ValueError
        if setting.ini:
            config.getini(setting.ini)


def test_the_readme_gives_the_cpu_wheel_index_and_a_pathspec_that_works_at_the_repository_root(tmp_path):
    import subprocess

    text = (ROOT / "README.md").read_text()
    assert "pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu" in text
    pathspec = re.search(r"git add '(:\(glob\)[^']+)'", (ROOT / "docs" / "guide" / "ci.md").read_text()).group(1)
    (tmp_path / "__qreport__").mkdir()
    (tmp_path / "__qreport__" / "root.json").write_text("{}")
    (tmp_path / "sub" / "__qreport__").mkdir(parents=True)
    (tmp_path / "sub" / "__qreport__" / "nested.json").write_text("{}")
    subprocess.run(["git", "init", "-q"], cwd=tmp_path, check=True)
    subprocess.run(["git", "add", pathspec], cwd=tmp_path, check=True)
    staged = subprocess.run(["git", "diff", "--cached", "--name-only"], cwd=tmp_path, check=True, capture_output=True,
                            text=True).stdout.split()
    assert sorted(staged) == ["__qreport__/root.json", "sub/__qreport__/nested.json"]


def test_the_failing_examples_fail_for_the_reasons_the_readme_gives(pytester, monkeypatch):
    import json
    import math

    from tests.helpers import run_examples

    report = pytester.path / "r.json"
    result = run_examples(pytester, monkeypatch, f"--qreport-json={report}", failing=True)
    rows = json.loads(report.read_text())["rows"]
    # the budget's use of every model whose searches ran, not only of the slowest three the timing line names
    budget = next(line for line in result.stdout.lines if line.startswith("fix budget used: "))
    assert "fragile " in budget and "sensor_mlp_unequalized " in budget, budget
    failing = sorted((r["model"], r["check"], r["layer"]) for r in rows if r["verdict"] == "fail")
    assert failing == [("fragile", "model_sqnr", "output"), ("fragile", "sqnr", "layers.4"),
                       ("fragile", "sqnr", "layers.6"), ("sensor_mlp_unequalized", "equalization", "layers.0"),
                       ("wide_rows_mlp", "per_channel", "layers.2")]
    text = (ROOT / "README.md").read_text()
    assert "5 items fail" in text
    outliers = [r for r in rows if r["model"] == "spiky_mlp" and r["check"] == "outlier"]
    assert all(isinstance(r["value"], float) and math.isfinite(r["value"]) for r in outliers)  # spikes, not zeros
    assert all(r["verdict"] == "pass" and "measured" in r["note"] for r in outliers)  # the heuristic, overruled
    fix = next(r["message"] for r in rows if r["check"] == "model_sqnr" and r["model"] == "fragile")
    assert "float_layers=[" in fix


def test_pytest_help_works_and_lists_every_setting(pytester):
    from pytest_qreport.checks import BUILTIN_CHECKS
    from pytest_qreport.core.settings import SESSION_SETTINGS, model_schema

    result = pytester.runpytest("--help")
    assert result.ret == 0, result.stderr.str()
    text = result.stdout.str()
    for setting in (*model_schema(BUILTIN_CHECKS).values(), *SESSION_SETTINGS):
        if setting.flag:
            assert setting.flag in text, f"{setting.flag} is missing from pytest --help"
        if setting.ini:
            assert f"{setting.ini} (" in text, f"ini key {setting.ini} is missing from pytest --help"
    assert "(causal LMs), in %" in text


def test_a_percent_sign_in_any_help_text_survives_argparse():
    import argparse

    from pytest_qreport.core.settings import argparse_help

    parser = argparse.ArgumentParser()
    for index, text in enumerate(["in %", "100% of %(default)s", "%%", "a %d b %s"]):
        parser.add_argument(f"--flag{index}", help=argparse_help(text))
    out = parser.format_help()
    assert "in %" in out and "100% of %(default)s" in out and "a %d b %s" in out


def test_every_package_of_the_tree_is_in_the_distribution():
    """setuptools lists the packages by name: one left out is missing from a wheel, though an editable install
    finds it."""
    tomllib = pytest.importorskip("tomllib")  # Python 3.11 on; CI's is 3.11

    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    tree = {".".join(init.parent.relative_to(ROOT).parts) for top in ("qcore", "pytest_qreport")
            for init in (ROOT / top).rglob("__init__.py")}
    assert tree == listed
