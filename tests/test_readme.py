"""The README's set-up commands are the ones CI runs."""
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parent.parent


def _readme_commands():
    return re.findall(r"```bash\n(python3 -m venv .*)\n```", (ROOT / "README.md").read_text())


def test_ci_runs_the_readme_test_command():
    commands = _readme_commands()
    assert len(commands) == 2
    ci = (ROOT / ".ci" / "run").read_text().strip().splitlines()[-1]
    assert ci == commands[1] and commands[1].endswith("pytest -n 2 tests/")
    assert commands[0].endswith("pytest --qreport examples/")


def test_the_options_table_is_the_settings_schema():
    from pytest_qreport.checks import BUILTIN_CHECKS
    from pytest_qreport.core.settings import options_table

    expected = options_table(BUILTIN_CHECKS)
    assert expected in (ROOT / "README.md").read_text(), f"README's options table should read:\n{expected}"


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
