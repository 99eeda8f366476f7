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
