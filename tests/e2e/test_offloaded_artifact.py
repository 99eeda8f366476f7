"""A checkpoint pair declared as a small machine loads it (accelerate's big-model offload: from_pretrained with
device_map, max_memory and offload_folder) is gated block by block and gives the rows of the same pair loaded whole,
serially and under -n 2: a dense Llama, and a Qwen3-MoE whose experts the checkpoint holds one by one and transformers
fuses again at load."""
import json
import math
import pathlib

import pytest

from tests.helpers import float_and_w4a16_checkpoints, float_and_w4a16_moe_checkpoints

pytest.importorskip("accelerate")

ROOT = pathlib.Path(__file__).resolve().parents[2]

CONFTEST = '''
import sys

sys.path.insert(0, {root!r})

import pytest  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

from pytest_qreport import qmodel  # noqa: E402
from tests.helpers import token_batches  # noqa: E402

CHECKPOINTS = {checkpoints!r}


def offloaded(name, folder):
    return AutoModelForCausalLM.from_pretrained(f"{{CHECKPOINTS}}/{{name}}", device_map="auto",
                                                max_memory={{"cpu": "150KiB"}}, offload_folder=folder).eval()


@pytest.fixture(scope="session")
def batches():
    return token_batches(3)


@qmodel(calibration="batches", quantized=lambda: AutoModelForCausalLM.from_pretrained(f"{{CHECKPOINTS}}/w4a16"),
        sqnr_min_db=10, weight_sqnr_min_db=10, top1_agreement_min=0.7)
def whole():
    return AutoModelForCausalLM.from_pretrained(f"{{CHECKPOINTS}}/float").eval()


@qmodel(calibration="batches", quantized=lambda: offloaded("w4a16", "offload-w4a16"), sqnr_min_db=10,
        weight_sqnr_min_db=10, top1_agreement_min=0.7)
def offload():
    return offloaded("float", "offload-float")
'''


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """A 4-layer tiny Llama saved in float, and its W4A16 compressed-tensors checkpoint."""
    return float_and_w4a16_checkpoints(tmp_path_factory.mktemp("checkpoints"))


@pytest.fixture(scope="module")
def moe_checkpoints(tmp_path_factory):
    """A 2-layer tiny Qwen3-MoE (4 experts) saved in float, and its W4A16 checkpoint written expert by expert."""
    return float_and_w4a16_moe_checkpoints(tmp_path_factory.mktemp("moe_checkpoints"))


def _rows(path):
    rows = {}
    for row in json.loads(path.read_text())["rows"]:
        rows.setdefault(row["model"], {})[(row["check"], row["layer"])] = row
    return rows


def _number(value):
    return float(value) if isinstance(value, (int, float, str)) else math.nan


@pytest.mark.parametrize("workers", [[], ["-n", "2", "-p", "xdist"]], ids=["serial", "xdist"])
@pytest.mark.parametrize(("pair", "layers"), [("checkpoints", 28), ("moe_checkpoints", 2 * 4 + 2 * 3)],
                         ids=["llama", "qwen3_moe"])
def test_an_offloaded_pair_is_gated_with_the_rows_of_the_pair_loaded_whole(pytester, request, pair, layers, workers):
    """Every default check, no error item; the MoE pair's items: each block's attention layers and one per expert
    projection (every expert measured)."""
    checkpoints = request.getfixturevalue(pair)
    pytester.makeconftest(CONFTEST.format(root=str(ROOT), checkpoints=str(checkpoints)))
    run = pytester.runpytest
    result = run("--qreport", "-p", "no:cacheprovider", "--qreport-json=r.json", *workers)
    rows = _rows(pytester.path / "r.json")
    whole, offload = rows["whole"], rows["offload"]
    assert not [key for rows in (whole, offload) for key, row in rows.items() if row["verdict"] == "error"], \
        result.stdout.str()[-3000:]
    assert set(whole) == set(offload)
    assert sum(1 for check, _ in offload if check == "sqnr") == layers   # every quantized layer
    for key, row in whole.items():
        a, b = _number(row["value"]), _number(offload[key]["value"])
        assert (math.isnan(a) and math.isnan(b)) or abs(a - b) <= 0.01 * max(1.0, abs(a)), (key, a, b)
        assert row["verdict"] == offload[key]["verdict"], key
    assert offload[("kl_divergence", "output")]["value"] == pytest.approx(whole[("kl_divergence", "output")]["value"],
                                                                          rel=0.01)


def test_a_pair_that_does_not_fit_even_block_by_block_is_an_error_naming_the_block_and_the_fix(pytester, checkpoints):
    pytester.makeconftest(CONFTEST.format(root=str(ROOT), checkpoints=str(checkpoints)))
    result = pytester.runpytest("--qreport", "-p", "no:cacheprovider", "-k", "offload", "--qreport-json=r.json",
                                "--qreport-memory-budget=64KiB")
    rows = _rows(pytester.path / "r.json")["offload"]
    assert {row["verdict"] for row in rows.values()} == {"error"}, result.stdout.str()[-2000:]
    message = rows[("sqnr", "model.layers.0.self_attn.q_proj")]["message"]
    assert "model 'offload': does not fit even one block at a time: model.layers." in message \
        or "model 'offload': does not fit even one block at a time: the modules outside the stack" in message
    assert "Fix: run it where more memory is free" in message
