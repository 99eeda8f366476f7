"""Every pointer in a message leads to a row that says what it promises: the examples' failing models and the
README's model under raised thresholds, each message read against the rows it names; and no fix keeps every
quantized layer in float."""
import ast
import json
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _readme_model():
    text = (ROOT / "README.md").read_text()
    return re.search(r"```python\n(# conftest.py of your model repository\n.*?)```", text, re.S).group(1)


def _rows(path):
    rows = json.loads(path.read_text())["rows"]
    return {(r["model"], r["check"], r["layer"]): r for r in rows}


def _check_pointers(rows, output):
    """Assert that each message's pointers hold in `rows` and in the terminal `output`; the pointers seen."""
    seen = set()
    quantized = {}
    for (model, check, layer) in rows:
        if check == "sqnr":
            quantized.setdefault(model, set()).add(layer)
    for (model, check, layer), row in rows.items():
        message = row["message"] or ""
        assert message.count("The fix search stopped at the model's fix budget") <= 1, message  # said once
        for listed in re.findall(r"float_layers=(\[[^\]]*\])", message):
            named = set(ast.literal_eval(listed))
            assert not quantized.get(model) or not quantized[model] <= named, (model, check, layer, message)
            seen.add("proper subset")
        shared = re.search(r"Fix: the one (\w+) fix for the (\d+) failing (\w+) items, given on the item of (\S+) "
                           r"and under the summary", message)
        if shared:
            setting, count, named_check, first = shared.groups()
            target = rows[(model, named_check, first)]
            assert target["verdict"] == "fail" and f"Fix: qmodel(..., {setting}=" in target["message"], target
            assert f"fix for {model}'s {count} failing {named_check} items: qmodel(..., {setting}=" in output
            seen.add("given on the item of")
        source = re.search(r"The first layer before it that fails on its own is (\S+): fix that one \(see its item\)",
                           message)
        if source:
            target = rows[(model, "sqnr", source.group(1))]
            assert target["verdict"] == "fail" and "Measured fixes:" in target["message"], target
            seen.add("see its item")
        if "the layers the model_sqnr item names" in message or "The model_sqnr item's measured fix" in message:
            fix = re.findall(r"float_layers=\[[^\]]*\]", message)[-1]
            target = rows[(model, "model_sqnr", "output")]
            assert target["verdict"] == "fail" and fix in target["message"], (message, target)
            seen.add("model_sqnr item")
        if "sensitivity" in message and "item" in message:
            assert rows[(model, "sensitivity", "model")]["verdict"] != "skip", message
            seen.add("sensitivity item")
        if "The model_sqnr item fails too" in message:
            target = rows[(model, "model_sqnr", "output")]
            assert target["verdict"] == "fail", message
            if "see the layers to keep in float that it measured" in message:
                assert "float_layers=" in target["message"], (message, target)
            if "see the format moves that it measured" in message:
                assert "layer_formats=" in target["message"], (message, target)
            if "within the fix budget it measured no fix" in message:
                assert "float_layers=" not in target["message"] and "fix_budget" in target["message"], target
                seen.add("no fix within the budget")
            if "the sensitivity item" in message:
                assert rows[(model, "sensitivity", "model")]["verdict"] != "skip", message
            seen.add("model_sqnr fails too")
        if "No layer search ran for the output: model_sqnr passes" in message:
            assert rows[(model, "model_sqnr", "output")]["verdict"] == "pass", message
            assert rows[(model, "sensitivity", "model")]["verdict"] == "skip", message
            seen.add("no layer search")
        first_failing = re.search(r"(\d+) per-layer sqnr item\(s\) fail too, the first (\S+):", message)
        if first_failing:
            assert rows[(model, "sqnr", first_failing.group(2))]["verdict"] == "fail", message
            assert int(first_failing.group(1)) == sum(row["verdict"] == "fail" for (m, c, _), row in rows.items()
                                                      if m == model and c == "sqnr"), message
            seen.add("sqnr items")
        if "this layer measures" in message:   # a proper subset's claim about a layer it leaves quantized
            seen.add("left quantized")
    return seen


def _run_forked(pytester, *args):
    """(rows by (model, check, layer), stdout) of `pytest --qreport` on pytester's project, in a forked child."""
    from tests.helpers import run_with_rows

    result, rows = run_with_rows(pytester, "-p", "no:xdist", *args)
    return rows, result.stdout.str()


def test_the_failing_examples_point_only_at_rows_that_hold_what_they_promise(pytester, monkeypatch):
    from tests.helpers import run_examples

    report = pytester.path / "report.json"
    models = "wide_rows_mlp or sensor_mlp_unequalized or fragile or spiky_mlp"
    result = run_examples(pytester, monkeypatch, "-k", models, f"--qreport-json={report}", failing=True)
    rows, output = _rows(report), result.stdout.str()
    seen = _check_pointers(rows, output)
    assert {"see its item", "model_sqnr item", "sqnr items", "proper subset"} <= seen, seen
    # the sensor model's equalization item prints its fix itself, and how to search further within a larger budget
    message = rows[("sensor_mlp_unequalized", "equalization", "layers.0")]["message"]
    assert "Fix: qmodel(..., equalize=['layers.0'])." in message and "given on the item of" not in message
    assert "search further with qmodel(fix_budget=2)" in message


@pytest.mark.parametrize("option", [["--qreport-sqnr-min-db", "45"], ["--qreport-sqnr-min-db", "38"],
                                    ["--qreport-model-sqnr-min-db", "45"]], ids=["sqnr45", "sqnr38", "model45"])
def test_the_readme_model_under_raised_thresholds_is_told_what_was_measured(pytester, option):
    pytester.makeconftest(_readme_model())
    rows, output = _run_forked(pytester, *option)
    seen = _check_pointers(rows, output)
    failing = {key: row for key, row in rows.items() if row["verdict"] == "fail"}
    assert failing
    if option == ["--qreport-sqnr-min-db", "45"]:
        # both layers fail on their own: no fix quantizes nothing; the best proper subset is named and measured
        assert {"proper subset", "left quantized"} <= seen
        for row in failing.values():
            assert "the threshold is above what this quantizer gives" in row["message"], row["message"]
        left = rows[("small_mlp", "sqnr", "2")]["message"]
        measured = float(re.search(r"this layer measures ([\d.]+) dB", left).group(1))
        pasted = re.search(r"qmodel\(\.\.\., (float_layers=\[[^\]]*\])\)", left).group(1)
        pytester.makeconftest(_readme_model().replace("sqnr_min_db=30.0", f"sqnr_min_db=30.0, {pasted}"))
        after, _ = _run_forked(pytester)
        assert after[("small_mlp", "sqnr", "2")]["value"] == pytest.approx(measured, abs=0.01)
        assert ("small_mlp", "sqnr", "0") not in after   # the pasted layer is in float
    elif option == ["--qreport-sqnr-min-db", "38"]:
        message = failing[("small_mlp", "sqnr", "2")]["message"]
        assert "sensitivity" not in message and "passing model_sqnr_min_db" in message
    else:
        message = failing[("small_mlp", "model_sqnr", "output")]["message"]
        assert "above what this quantizer gives" in message and "float_layers=['0']" in message


def test_a_failing_output_gate_points_only_at_items_that_measured_layers_and_its_hint_runs_the_ranking(pytester):
    """KL and top-1 fail while model_sqnr passes (so the sensitivity ranking is skipped): the items say no layer
    search ran and give the setting that runs it; pasted, the ranking runs. With model_sqnr failing too, they point
    at it."""
    pytester.makeconftest(_readme_model())
    rows, output = _run_forked(pytester, "--qreport-kl-max-nats", "0", "--qreport-top1-agreement-min", "1.0",
                                "--qreport-sqnr-min-db", "0")
    assert {"no layer search"} <= _check_pointers(rows, output)
    message = rows[("small_mlp", "kl_divergence", "output")]["message"]
    assert message.startswith("model output: mean KL"), message  # not 'model output output'
    pasted = re.search(r"qmodel\(\.\.\., (check_options=\{.*?\}\})\)", message).group(1)
    pytester.makeconftest(_readme_model().replace("sqnr_min_db=30.0", f"sqnr_min_db=30.0, {pasted}"))
    after, output = _run_forked(pytester, "--qreport-kl-max-nats", "0", "--qreport-sqnr-min-db", "0")
    ranking = after[("small_mlp", "sensitivity", "model")]
    assert ranking["verdict"] != "skip" and ranking["details"]["ranking"], ranking
    assert "See the sensitivity item's ranking" in after[("small_mlp", "kl_divergence", "output")]["message"]
    _check_pointers(after, output)
    failing, output = _run_forked(pytester, "--qreport-kl-max-nats", "0", "--qreport-model-sqnr-min-db", "60",
                                   "--qreport-sqnr-min-db", "0")
    assert {"model_sqnr fails too", "sensitivity item"} <= _check_pointers(failing, output)


MOE_MODEL = """
import pytest

from pytest_qreport import qmodel
from tests.models import tiny_moe


@pytest.fixture
def tokens():
    return tiny_moe("qwen3_moe", layers=2, experts=8, width=64, n=4)[1]


# every default check under W4A16, its experts' down_proj (64 input features) in W8A16, as the items advise
@qmodel(calibration="tokens", quantizer="W4A16", layer_formats={"model.layers.*.mlp.experts.*.down_proj": "W8A16"})
def moe():
    return tiny_moe("qwen3_moe", layers=2, experts=8, width=64)[0]


# static int8, its fix searches given twice its verdict pass's graph runs: its output search measures a fix
@qmodel(calibration="tokens", fix_budget=2)
def deepseek():
    return tiny_moe("deepseek_v3", layers=2, experts=8)[0]
"""


def test_an_moe_models_pointers_name_items_and_say_what_the_items_they_name_measured(pytester):
    """Its failing output items point at the model_sqnr item and count the sqnr items that fail, an expert
    projection one item; where the fix budget was spent before the output's layer search, they say it measured
    none (the W4A16 model), where it measured a fix, they point at it (the int8 one)."""
    pytester.makeconftest(MOE_MODEL)
    rows, output = _run_forked(pytester)
    seen = _check_pointers(rows, output)
    assert {"model_sqnr fails too", "sqnr items", "no fix within the budget"} <= seen, seen
    assert "see the layers to keep in float that it measured" in rows[("deepseek", "top1_agreement", "output")][
        "message"]
