"""Several artifacts gated against one reference in one declaration (qmodel(quantized={name: artifact})): node ids
name each artifact, the reference is built once and run once per batch for all of them, every value is the one the
artifact gets declared alone, an artifact that fails to load errors alone, serially and under xdist."""
import json
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]  # the project below imports tests.helpers from it

GROUP_SOURCE = '''
import os
import os
import pathlib
import sys

sys.path.insert(0, {root!r})

import pytest  # noqa: E402
from torchao.quantization import Int8DynamicActivationInt8WeightConfig, Int8WeightOnlyConfig

from pytest_qreport import qmodel
from tests.helpers import compressed_tensors_checkpoint, tiny_llama, token_batches, torchao_artifact

LOG = pathlib.Path(__file__).parent / "reference.log"
SETTINGS = dict(calibration="batches", checks=["sqnr", "weight_sqnr", "model_sqnr", "kl_divergence"],
                sqnr_min_db=5, model_sqnr_min_db=5, weight_sqnr_min_db=5)


@pytest.fixture(scope="session")
def batches():
    return token_batches()


@pytest.fixture
def w8a8():
    return torchao_artifact(tiny_llama(), Int8DynamicActivationInt8WeightConfig())


@pytest.fixture
def w8a16():
    return torchao_artifact(tiny_llama(), Int8WeightOnlyConfig())


def checkpoint(tmp_path_factory):
    return compressed_tensors_checkpoint(tiny_llama(), tmp_path_factory.mktemp("w4a16"), "W4A16", group_size=32)


@pytest.fixture
def w4a16(tmp_path_factory):
    return checkpoint(tmp_path_factory)


def _logged(what):
    with LOG.open("a") as log:
        log.write(what + os.environ.get("PYTEST_XDIST_WORKER", "") + "\\n")


@qmodel(quantized={{"w8a8": "w8a8", "w8a16": "w8a16", "w4a16": "w4a16",
                    "broken": lambda: torchao_artifact(tiny_llama(layers=3), Int8WeightOnlyConfig())}}, **SETTINGS)
def llama():
    _logged("built")
    reference = tiny_llama()
    reference.register_forward_pre_hook(lambda module, args: _logged("forward"))
    return reference


@qmodel(quantized="w8a8", **SETTINGS)
def alone_w8a8():
    return tiny_llama()


@qmodel(quantized="w8a16", **SETTINGS)
def alone_w8a16():
    return tiny_llama()


@qmodel(quantized="w4a16", **SETTINGS)
def alone_w4a16():
    return tiny_llama()
'''


def _run(pytester, *args):
    pytester.makeconftest(GROUP_SOURCE.format(root=str(ROOT)))
    log = pytester.path / "reference.log"
    if log.exists():
        log.unlink()
    result = pytester.runpytest("--qreport", "-p", "no:cacheprovider", "--qreport-json=r.json", *args)
    report = json.loads((pytester.path / "r.json").read_text())
    rows = {(row["model"], row["check"], row["layer"]): row for row in report["rows"]}
    return result, rows, log.read_text().split()


@pytest.mark.parametrize("workers", [(), ("-n", "2")], ids=["serial", "xdist"])
def test_one_declaration_gates_each_artifact_against_one_reference(pytester, workers):
    result, rows, log = _run(pytester, *workers)
    members = {"w8a8", "w8a16", "w4a16"}
    for member in members:
        own = {key[1:]: row for key, row in rows.items() if key[0] == f"llama[{member}]"}
        alone = {key[1:]: row for key, row in rows.items() if key[0] == f"alone_{member}"}
        assert len(own) == len(alone) > 20, member  # sqnr and weight_sqnr per layer, the output checks
        for key, row in alone.items():
            assert (own[key]["verdict"], own[key]["value"]) == (row["verdict"], row["value"]), (member, key)
    # three artifacts, three sets of numbers
    assert len({rows[(f"llama[{member}]", "model_sqnr", "output")]["value"] for member in members}) == 3
    # the node ids name each artifact, and -k selects one
    result.stdout.no_fnmatch_line("*alone_*FAILED*")
    broken = rows[("llama[broken]", "capture", "")]
    assert broken["verdict"] == "error" and "model 'llama[broken]'" in broken["message"]
    assert "only in the quantized model" in broken["message"] or "do not match" in broken["message"]
    # the reference: built once per process that holds the group, run once per batch for every artifact
    # the reference: built once serially; under xdist by the worker that collects the group, by the other one to
    # report the broken artifact's error itself (the rendezvous passes no failed model on), and by the worker that
    # analyses the group when that is not the one that collected it; run once per batch for every artifact
    builds = [entry for entry in log if entry.startswith("built")]
    assert 1 <= len(builds) <= (1 if not workers else 3)
    forwards = [entry for entry in log if entry.startswith("forward")]
    assert len(forwards) == 4 and len(set(forwards)) == 1  # token_batches(): 4 batches, not 4 per artifact
    outcomes = result.parseoutcomes()
    assert outcomes["errors"] == 1 and "failed" not in outcomes


def test_node_ids_name_the_artifact_and_a_bad_mapping_errors_on_its_model(pytester):
    pytester.makeconftest(GROUP_SOURCE.format(root=str(ROOT)) + '''

@qmodel(calibration="batches", quantized={"w/8": "w8a8"})
def slashed():
    return tiny_llama()
''')
    result = pytester.runpytest("--qreport", "-p", "no:cacheprovider", "-v", "-k",
                                "slashed or llama[w8a16] and model_sqnr")
    result.stdout.fnmatch_lines(["*::qreport/llama[[]w8a16]/model_sqnr/output PASSED*"])
    result.stdout.fnmatch_lines(["*model 'slashed': quantized= maps names to the artifacts gated against one "
                                 "reference, and its keys [[]'w/8'] are not names*Fix: quantized={'w4a16': *"])
    result.assert_outcomes(passed=1, errors=1)
