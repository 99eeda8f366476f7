"""Mixture-of-experts models through the plugin: one item per expert projection judged on its worst expert, the
experts calibration never reached named by expert_coverage, and the router's choices by routing_agreement."""
import json

import pytest

from tests.helpers import summary_section

pytest.importorskip("transformers")

MOE_CONFTEST = '''
import pytest
import torch

from pytest_qreport import qmodel
from tests.models import tiny_moe

CHECKS = "sqnr,weight_sqnr,expert_coverage,routing_agreement,model_sqnr"


@pytest.fixture
def tokens():
    return tiny_moe("qwen3_moe", n=4)[1]


@qmodel(calibration="tokens", quantizer="W4A16", checks=CHECKS)
def qwen3_moe():
    return tiny_moe("qwen3_moe")[0]


def with_a_starved_expert():
    model = tiny_moe("qwen3_moe", experts=5)[0]
    router = model.model.layers[0].mlp.gate.weight
    with torch.no_grad():  # logits (a, -a, 0, b, -b): |a| and |b| win the top-2, expert 2 never does
        router[1], router[2], router[4] = -router[0], 0.0, -router[3]
    return model


@qmodel(calibration="tokens", quantizer="W4A16", checks="sqnr,cosine,expert_coverage",
        severity={"cosine": "fail"}, check_options={"sqnr": {"fix": False}})
def starved_expert():
    return with_a_starved_expert()


@qmodel(calibration="tokens", fix_budget=0)
def starved_expert_every_check():
    return with_a_starved_expert()


@qmodel(calibration="tokens", quantizer="W4A16", checks="routing_agreement", float_layers={float_layers})
def router_in_float():
    return tiny_moe("qwen3_moe")[0]
'''


def _run(pytester, *args, float_layers="['model.layers.0.mlp.gate']", models=None):
    pytester.makeconftest(MOE_CONFTEST.replace("{float_layers}", float_layers))
    result = pytester.runpytest("--qreport", "-p", "no:cacheprovider", "--qreport-json=moe.json", *args)
    report = json.loads((pytester.path / "moe.json").read_text())
    if models is not None:
        models.update(report["models"])
    return result, {(row["model"], row["check"], row["layer"]): row for row in report["rows"]}


def test_moe_items_are_per_expert_projection_and_name_their_worst_experts(pytester):
    models: dict = {}
    result, rows = _run(pytester, models=models)
    block = "model.layers.0.mlp.experts"
    layers = {layer for model, check, layer in rows if model == "qwen3_moe" and check in ("sqnr", "weight_sqnr")}
    assert {f"{block}.gate_up_proj", f"{block}.down_proj"} <= layers
    assert not [layer for layer in layers if layer.startswith(block + ".") and layer.split(".")[5].isdigit()]
    for check in ("sqnr", "weight_sqnr"):
        down = rows[("qwen3_moe", check, f"{block}.down_proj")]
        values = down["details"]["experts"]
        assert sorted(values) == ["0", "1", "2", "3"]
        worst = min(values, key=values.get)
        assert down["value"] == pytest.approx(values[worst]) and down["details"]["worst_expert"] == int(worst)
        gate_up = rows[("qwen3_moe", check, f"{block}.gate_up_proj")]["details"]["experts"]
        assert sorted(gate_up) == sorted(f"{e}.{half}" for e in range(4) for half in ("gate_proj", "up_proj"))
        if down["verdict"] == "fail":
            assert f"{block}.down_proj: 4 experts" in down["message"]
            assert f"judged on expert {worst}; worst: {worst} ({values[worst]:.2f} dB)" in down["message"]
    # the expert no token reaches is named, with what to change, in the tools' words
    starved = rows[("starved_expert", "expert_coverage", block)]
    assert starved["verdict"] == "fail" and starved["value"] == 0 and starved["details"]["starved_experts"][0] == 2
    assert "expert (tokens) 2 (0)" in starved["message"] and "moe_calibrate_all_experts=True" in starved["message"]
    assert rows[("qwen3_moe", "expert_coverage", block)]["value"] > 0
    # its items cannot vouch for it: they fail, saying so, whatever its siblings measure
    down = rows[("starved_expert", "sqnr", f"{block}.down_proj")]
    assert down["verdict"] == "fail" and down["details"]["unmeasured_experts"] == [2]
    assert "Not measured: expert(s) 2, which no calibration token reached" in down["message"]
    cosine = rows[("starved_expert", "cosine", f"{block}.down_proj")]
    assert cosine["details"]["unmeasured_experts"] == [2] and "cosine similarity nan" not in cosine["message"]
    # under every default check and static int8 activations too: the detectors and equalization measure the
    # experts that tokens reached and say which one they could not
    every = {key[1:]: row for key, row in rows.items() if key[0] == "starved_expert_every_check"}
    assert every[("expert_coverage", block)]["details"]["starved_experts"][0] == 2
    for check in ("sqnr", "input_weight_equalization", "equalization", "outlier", "dynamic_static"):
        assert "Not measured: expert(s) 2, which no calibration token reached" in \
            every[(check, f"{block}.down_proj")]["message"], check
    # the detectors saw nothing of it: no fix to measure, so no verdict waited for a trial of the whole model
    assert "verdict trials" not in models["starved_expert_every_check"]["seconds"]
    routing = rows[("qwen3_moe", "routing_agreement", block)]
    assert 0 < routing["value"] <= 1 and routing["details"]["router"] == "model.layers.0.mlp.gate"
    # the router in float, as the routing_agreement advice says: its choices are the float model's
    assert rows[("router_in_float", "routing_agreement", block)]["verdict"] == "pass"
    if routing["verdict"] == "fail":
        assert "qmodel(..., float_layers=['model.layers.0.mlp.gate'])" in routing["message"]
    assert not [key for key, row in rows.items() if row["verdict"] == "error"]
    serial = summary_section(result)
    xdist, _ = _run(pytester, "-n", "2")
    assert summary_section(xdist) == serial


ARTIFACT_CONFTEST = '''
import copy

import pytest
import torch

from pytest_qreport import qmodel
from qcore.formats.presets import preset
from tests.models import tiny_moe


@pytest.fixture
def tokens():
    return tiny_moe("qwen3_moe", n=4)[1]


def dequantized_at_load(zeroed=()):
    """What transformers 5 makes of a W4A16 MoE checkpoint: fused experts, dequantized to float at load; attention
    quantized too. `zeroed`: experts the checkpoint holds as zeros (GPTQ's, when no calibration token reached them)."""
    model = tiny_moe("qwen3_moe")[0]
    weights = preset("W4A16").weight
    with torch.no_grad():
        for layer in model.model.layers:
            for fused in (layer.mlp.experts.gate_up_proj, layer.mlp.experts.down_proj):
                fused.copy_(torch.stack([weights.fake_quantize(w, weight=True) for w in fused]))
                fused[list(zeroed)] = 0.0
            for projection in ("q_proj", "k_proj", "v_proj", "o_proj"):
                weight = getattr(layer.self_attn, projection).weight
                weight.copy_(weights.fake_quantize(weight, weight=True))
    return model


@pytest.fixture
def sound():
    return dequantized_at_load()


@pytest.fixture
def zeroed():
    return dequantized_at_load(zeroed=(3,))


@qmodel(calibration="tokens", quantized="sound", checks="expert_coverage,model_sqnr")
def sound_checkpoint():
    return tiny_moe("qwen3_moe")[0]


@qmodel(calibration="tokens", quantized="zeroed", checks="expert_coverage,model_sqnr")
def zeroed_checkpoint():
    return tiny_moe("qwen3_moe")[0]
'''


def test_a_checkpoint_whose_expert_is_zeros_fails_naming_it(pytester):
    pytester.makeconftest(ARTIFACT_CONFTEST)
    pytester.runpytest("--qreport", "-p", "no:cacheprovider", "--qreport-json=moe.json")
    rows = {(row["model"], row["check"], row["layer"]): row
            for row in json.loads((pytester.path / "moe.json").read_text())["rows"]}
    block = "model.layers.0.mlp.experts"
    sound = rows[("sound_checkpoint", "expert_coverage", block)]
    assert sound["verdict"] == "pass" and "compared one by one with the reference's" in sound["note"]
    assert all(15 < value < 25 for value in sound["details"]["weight_sqnr_db"]["down_proj"])  # 4-bit weights
    zeroed = rows[("zeroed_checkpoint", "expert_coverage", block)]
    assert zeroed["verdict"] == "fail" and zeroed["details"]["zeros"] == [3]
    assert "holds 1 of its 4 experts as zeros: expert(s) 3" in zeroed["message"]
    assert "moe_calibrate_all_experts=True" in zeroed["message"]
    assert not [key for key, row in rows.items() if row["verdict"] == "error"]
