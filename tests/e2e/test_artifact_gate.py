"""Gating the artifact a team ships: qmodel(quantized=...) with torchao and compressed-tensors artifacts of a tiny
Llama, serial and under xdist; every value against a direct computation with hooks on both models."""
import json
import pathlib

import pytest
from torchao.quantization import Int8DynamicActivationInt8WeightConfig

from tests.e2e.test_advice_pointers import _check_pointers
from tests.helpers import compressed_tensors_checkpoint, direct_layer_sqnr, tiny_llama, token_batches, torchao_artifact

DAMAGED = "model.layers.0.self_attn.v_proj"
ROOT = pathlib.Path(__file__).resolve().parents[2]  # the projects below import tests.helpers from it

ARTIFACT_SOURCE = '''
import sys

sys.path.insert(0, {root!r})

import pytest  # noqa: E402
from torchao.quantization import Int8DynamicActivationInt8WeightConfig

from pytest_qreport import qmodel
from tests.e2e.test_advice_pointers import _check_pointers
from tests.helpers import compressed_tensors_checkpoint, tiny_llama, token_batches, torchao_artifact


@pytest.fixture(scope="session")
def batches():
    return token_batches()


@pytest.fixture(scope="session")
def llama_int8():
    return torchao_artifact(tiny_llama(), Int8DynamicActivationInt8WeightConfig())


@pytest.fixture(scope="session")
def llama_w8a8(tmp_path_factory):
    return compressed_tensors_checkpoint(tiny_llama(), tmp_path_factory.mktemp("checkpoint"), "W8A8",
                                         damaged={damaged!r})


@qmodel(calibration="batches", quantized="llama_int8", weight_sqnr_min_db=60)
def llama():
    return tiny_llama()


@qmodel(calibration="batches", quantized="llama_w8a8", sqnr_min_db=36, model_sqnr_min_db=40, kl_max_nats=1e-3,
        checks=["sqnr", "weight_sqnr", "model_sqnr", "kl_divergence"]{options})
def shipped():
    return tiny_llama()


@qmodel(calibration="batches", quantized=lambda: torchao_artifact(tiny_llama(layers=3),
                                                                  Int8DynamicActivationInt8WeightConfig()))
def mismatched():
    return tiny_llama()
'''


def _run(pytester, *args, damaged=DAMAGED, options=""):
    pytester.makeconftest(ARTIFACT_SOURCE.format(root=str(ROOT), damaged=damaged, options=options))
    result = pytester.runpytest("--qreport", "-p", "no:cacheprovider", "--qreport-json=r.json", *args)
    report = json.loads((pytester.path / "r.json").read_text())
    return result, {(row["model"], row["check"], row["layer"]): row for row in report["rows"]}


def _torchao_items_equal_hooks_on_both_models(rows):
    reference = tiny_llama()
    quantized = torchao_artifact(reference, Int8DynamicActivationInt8WeightConfig())
    layers = [layer for (model, check, layer) in rows if model == "llama" and check == "sqnr"]
    assert len(layers) == 15 and layers[-1] == "lm_head"  # 14 linears and the head: every Int8Tensor weight
    direct, kl = direct_layer_sqnr(reference, quantized, layers, token_batches())
    for layer in layers:
        assert rows[("llama", "sqnr", layer)]["value"] == pytest.approx(direct[layer], abs=0.05)
    assert rows[("llama", "kl_divergence", "output")]["value"] == pytest.approx(kl, rel=0.02, abs=1e-7)
    # GPTQ and AWQ lower weight SQNR on purpose: in artifact mode weight_sqnr warns
    assert {rows[("llama", "weight_sqnr", layer)]["verdict"] for layer in layers} == {"warn"}
    for check in ("per_channel", "dynamic_static", "input_weight_equalization", "outlier", "equalization"):
        row = rows[("llama", check, "model")]
        assert row["verdict"] == "skip" and "the model is quantized already" in row["message"]


def _damaged_layer_fails_and_the_output_names_a_fix(rows, directory):
    order = [layer for (model, check, layer) in rows if model == "shipped" and check == "sqnr"]
    reference = tiny_llama()
    checkpoint = compressed_tensors_checkpoint(reference, directory, "W8A8", damaged=DAMAGED)
    direct, kl = direct_layer_sqnr(reference, checkpoint, order, token_batches())
    assert len(order) == 14  # lm_head is in its ignore list
    for layer in order:
        assert rows[("shipped", "sqnr", layer)]["value"] == pytest.approx(direct[layer], abs=0.05)
    assert rows[("shipped", "kl_divergence", "output")]["value"] == pytest.approx(kl, rel=0.02)
    damaged = order.index(DAMAGED)
    assert rows[("shipped", "sqnr", DAMAGED)]["verdict"] == "fail"
    assert all(rows[("shipped", "sqnr", layer)]["verdict"] == "pass" for layer in order[:damaged])
    # its own item points at the output's fix; the layers after it inherit its error
    assert "the layers the model_sqnr item names" in rows[("shipped", "sqnr", DAMAGED)]["message"]
    assert f"The first layer before it that fails on its own is {DAMAGED}" in \
        rows[("shipped", "sqnr", order[damaged + 1])]["message"]
    output = rows[("shipped", "model_sqnr", "output")]
    recipe = output["details"]["recipe"]
    assert output["verdict"] == "fail" and DAMAGED in recipe["float_layers"] and recipe["reached"]
    assert f"{DAMAGED!r}" in recipe["llm-compressor"] and recipe["tool"] == "compressed-tensors"
    assert f"{{'quantizer_name': '*{DAMAGED}*', 'enable': False}}" in recipe["modelopt"]
    assert "filter_fn=lambda module, fqn:" in recipe["torchao"] and "llm_int8_skip_modules" in recipe["bitsandbytes"]
    assert f"qmodel(..., {recipe['qmodel']})" in output["message"]
    # the line of the tool that made the artifact, and no other tool's
    assert f"in llm-compressor, which made the artifact: {recipe['llm-compressor']}" in output["message"]
    assert "quant_cfg" not in output["message"] and "filter_fn" not in output["message"]
    return recipe


def test_shipped_artifacts_are_gated_layer_by_layer_with_a_verified_fix_serially_and_under_xdist(pytester, tmp_path):
    result, rows = _run(pytester, "--qreport-update-baseline", "--qreport-html=report.html")
    _torchao_items_equal_hooks_on_both_models(rows)
    recipe = _damaged_layer_fails_and_the_output_names_a_fix(rows, tmp_path)
    # every pointer of artifact mode leads to a row that holds what it promises
    assert {"model_sqnr item", "see its item"} <= _check_pointers(rows, result.stdout.str())
    html = (pytester.path / "report.html").read_text()
    assert "layers to keep in float (model_sqnr, measured: reaches the threshold)" in html
    assert "filter_fn=lambda module, fqn:" in html
    # names that match nothing error that model's items; the others ran on
    result.stdout.fnmatch_lines(["*model 'mismatched': the quantized model's modules do not match the float "
                                 "reference's by name: only in the quantized model (*): model.layers.2*"])
    assert rows[("mismatched", "capture", "")]["verdict"] == "error"
    _, parallel = _run(pytester, "-n", "2")
    assert {key: row["value"] for key, row in rows.items() if key[1] != "baseline"} == \
        {key: row["value"] for key, row in parallel.items() if key[1] != "baseline"}
    # the fix pasted back passes
    _, pasted = _run(pytester, "-k", "shipped", options=f", {recipe['qmodel']}")
    assert pasted[("shipped", "model_sqnr", "output")]["verdict"] == "pass"
    assert pasted[("shipped", "model_sqnr", "output")]["value"] == pytest.approx(recipe["measured"], abs=1e-6)
    # the layer kept in float is the reference's module: no per-layer item, and no false "not measured" warning
    assert ("shipped", "sqnr", DAMAGED) not in pasted and ("shipped", "weight_sqnr", DAMAGED) not in pasted
    assert not [row for row in pasted.values() if "not measured" in row["message"]]
    # another artifact against the baseline: compared, and said
    _, changed = _run(pytester, "-k", "shipped", damaged="model.layers.1.mlp.up_proj")
    assert "artifact changed since the baseline (sha256:" in changed[("shipped", "baseline", "")]["message"]
    regressed = changed[("shipped", "sqnr", "model.layers.1.mlp.up_proj")]
    assert regressed["baseline_status"] == "regressed"
    assert "The artifact changed since the baseline" in regressed["message"]


def test_the_qreport_fixture_takes_quantized_too(pytester):
    pytester.makepyfile(f'''
import sys

sys.path.insert(0, {str(ROOT)!r})

from tests.e2e.test_advice_pointers import _check_pointers
from tests.helpers import compressed_tensors_checkpoint, tiny_llama, token_batches  # noqa: E402


def test_shipped_checkpoint(qreport, tmp_path):
    reference = tiny_llama()
    quantized = compressed_tensors_checkpoint(reference, tmp_path, "W4A16", 32)
    result = qreport.analyze(reference, token_batches(), quantized=quantized, checks=["sqnr", "kl_divergence"],
                             sqnr_min_db=12, kl_max_nats=0.01)
    assert len([f for f in result.findings if f.check == "sqnr"]) == 14
    result.assert_checks()
''')
    pytester.runpytest("-p", "no:cacheprovider").assert_outcomes(passed=1)
