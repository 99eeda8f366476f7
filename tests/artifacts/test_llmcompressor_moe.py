"""llm-compressor 0.14 checkpoints of a tiny Qwen3-MoE, loaded as a user of transformers 5.24 loads them (experts
fused again and dequantized at load). tests/data/llmcompressor_moe/make.py made them with llm-compressor in its own
environment: W4A16 with QuantizationModifier and with GPTQ (the experts calibrated as routed, so the one expert the
router never chooses gets no token), FP8_DYNAMIC and NVFP4."""
import math
import pathlib

import pytest
import torch
import transformers
from safetensors import safe_open

from pytest_qreport.checks import BUILTIN_CHECKS
from pytest_qreport.core.pipeline import collect_model
from pytest_qreport.core.settings import ModelSettings
from qcore.artifact import ArtifactAnalysis
from qcore.formats.presets import preset
from qcore.numeric import compute_sqnr
from tests.helpers import builtin_registry

DATA = pathlib.Path(__file__).resolve().parents[1] / "data" / "llmcompressor_moe"
BLOCK = "model.layers.0.mlp.experts"
UNREACHED = 2  # make.py's router never chooses it


def _loaded(name, dtype=None):
    return transformers.AutoModelForCausalLM.from_pretrained(DATA / name, device_map="cpu", dtype=dtype).eval()


def _batches():
    generator = torch.Generator().manual_seed(2)
    return [{"input_ids": torch.randint(0, 128, (2, 16), generator=generator)} for _ in range(3)]


def _gated(name, checks=("expert_coverage", "model_sqnr"), dtype=None):
    """{(check, item): Finding} of the checkpoint gated against its reference, as the plugin does."""
    reference, quantized, batches = _loaded("reference"), _loaded(name, dtype), _batches()
    settings = ModelSettings.defaults(BUILTIN_CHECKS, calibration=batches, quantized=lambda: quantized,
                                      checks=list(checks))
    pipeline = collect_model("moe", settings, builtin_registry(), None, reference, batches[0], quantized=quantized)
    pipeline.analyze(lambda: batches, lambda found: None)
    return pipeline.findings


@pytest.mark.parametrize(("name", "format_name", "tolerance_db"), [("w4a16", "W4A16", 0.05),
                                                                     ("fp8_dynamic", "FP8_DYNAMIC", 0.0)])
def test_each_expert_as_loaded_is_its_reference_expert_in_the_recipes_format(name, format_name, tolerance_db):
    """Each expert's weight SQNR read from the checkpoint is the one our format of the same name gives the reference
    expert: FP8_DYNAMIC bit for bit, W4A16 to 0.05 dB (a few values per expert one step apart)."""
    reference, quantized = _loaded("reference"), _loaded(name)
    found = ArtifactAnalysis(reference, quantized, _batches()).checkpoint_experts[BLOCK]
    assert found.experts == 5 and not found.zeros and not found.non_finite
    experts = reference.model.layers[0].mlp.experts
    half = experts.gate_up_proj.shape[1] // 2  # gate_up_proj [E, 2I, H]: the gate's rows, then the up's
    projections = {"gate_proj": ("gate_up_proj", slice(0, half)), "up_proj": ("gate_up_proj", slice(half, None)),
                   "down_proj": ("down_proj", slice(None))}
    assert sorted(found.weight_sqnr_db) == sorted(projections)   # per projection, as the items are named
    for projection, (parameter, rows) in projections.items():
        for expert, weight in enumerate(getattr(experts, parameter).detach()):
            weight = weight[rows]
            ours = preset(format_name).weight.fake_quantize(weight, weight=True)
            if tolerance_db == 0.0:
                loaded = getattr(quantized.model.layers[0].mlp.experts, parameter)[expert][rows]
                assert torch.equal(loaded, ours), (projection, expert)
            assert found.weight_sqnr_db[projection][expert] == pytest.approx(
                float(compute_sqnr(weight, ours)), abs=tolerance_db + 1e-4), (projection, expert)
            assert found.scale_fit[projection][expert][0] == pytest.approx(1.0, abs=0.01)


def test_gptqs_expert_that_calibration_never_reached_is_named_with_llm_compressors_fix():
    found = _gated("gptq_w4a16")
    coverage = found[("expert_coverage", BLOCK)]
    assert coverage.verdict == "fail" and coverage.details["zeros"] == [UNREACHED], coverage.message
    assert f"as zeros: expert(s) {UNREACHED} (GPTQ writes an expert that no calibration token reached" in \
        coverage.message
    assert "llm-compressor: oneshot(..., moe_calibrate_all_experts=True)" in coverage.message


def test_nvfp4_experts_loaded_without_their_global_scale_are_named_as_scaled_wrong():
    """transformers 5.24 with compressed-tensors 0.20 loads these NVFP4 experts fused and dequantized with their
    global scale multiplied in, where the checkpoint's values are divided by it (read by hand below: 20 dB): every
    expert is its reference times that scale, and the item says so."""
    found = _gated("nvfp4")
    coverage = found[("expert_coverage", BLOCK)]
    assert coverage.verdict == "fail" and coverage.details["scaled_wrong"] == list(range(5)), coverage.message
    assert "scaled wrong: expert(s) 0, 1, 2, 3, 4 hold their reference weights times about" in coverage.message
    with safe_open(DATA / "nvfp4" / "model.safetensors", "pt") as stored:
        global_scale = float(stored.get_tensor(f"{BLOCK}.1.down_proj.weight_global_scale"))
    factor = coverage.details["weight_scale_factor"]["down_proj"][1]
    assert factor == pytest.approx(global_scale, rel=0.01)
    # and the model as loaded cannot run on the CPU: its attention layers decompress to bfloat16 beside float32;
    # loaded in bfloat16, as the item says, it runs, and every expert is measured as its own layer
    output = found[("model_sqnr", "output")]
    assert output.verdict == "error" and "in layer model.layers.0.self_attn.q_proj" in output.message
    assert "load the artifact in the dtype its layers compute in, bfloat16 (transformers: from_pretrained(..., " \
        "dtype=torch.bfloat16))" in output.message
    loaded = _gated("nvfp4", checks=("sqnr", "expert_coverage", "model_sqnr"), dtype=torch.bfloat16)
    assert not [key for key, finding in loaded.items() if finding.verdict == "error"]
    assert loaded[("expert_coverage", BLOCK)].details["scaled_wrong"] == list(range(5))
    for projection in ("gate_proj", "up_proj", "down_proj"):  # the experts module holds their own weights
        item = loaded[("sqnr", f"{BLOCK}.{projection}")]
        assert item.verdict == "fail" and item.value < -60 and "rescales" not in item.message, item.message
    # the checkpoint itself is sound: its values divided by the global scale are a 4-bit copy of the reference
    reference = _loaded("reference").model.layers[0].mlp.experts.down_proj[1].detach()
    with safe_open(DATA / "nvfp4" / "model.safetensors", "pt") as stored:
        packed = stored.get_tensor(f"{BLOCK}.1.down_proj.weight_packed")
        scales = stored.get_tensor(f"{BLOCK}.1.down_proj.weight_scale").float()
    e2m1 = torch.tensor([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6])
    values = torch.stack([e2m1[(packed & 0xF).long()], e2m1[(packed >> 4).long()]], -1).reshape(packed.shape[0], -1)
    weight = (values.reshape(values.shape[0], -1, 16) * (scales / global_scale).unsqueeze(-1)).reshape(values.shape)
    assert 15 < float(compute_sqnr(reference, weight)) < 30 and not math.isnan(factor)


def test_experts_fused_again_at_load_are_measured_expert_by_expert_on_the_references_tokens():
    """Each expert of the loaded W4A16 checkpoint is a layer: its SQNR is its loaded weight's output on the tokens
    the reference routes to it against the reference expert's (forward hooks on a linearized copy of the
    reference); the expert no token reaches is not measured, and its item says so."""
    from tests.models import layer_calls, linearized_moe

    reference, quantized, batches = _loaded("reference"), _loaded("w4a16"), _batches()
    analysis = ArtifactAnalysis(reference, quantized, batches)
    assert len(analysis.expert_layers) == 15
    calls = layer_calls(linearized_moe(reference), [f"{BLOCK}.{e}.down_proj" for e in range(5)], batches)
    loaded = quantized.model.layers[0].mlp.experts.down_proj.detach()
    for expert in range(5):
        measured = analysis.sqnr.layers[f"{BLOCK}.{expert}.down_proj"]
        if expert == UNREACHED:
            assert measured.batches == 0 and math.isnan(measured.sqnr_db)
            continue
        inputs, outputs = calls[f"{BLOCK}.{expert}.down_proj"]
        ours = torch.cat([torch.nn.functional.linear(x, loaded[expert]) for x in inputs])
        assert measured.sqnr_db == pytest.approx(float(compute_sqnr(torch.cat(outputs), ours)), abs=0.01)
    found = _gated("w4a16", checks=("sqnr",))
    down = found[("sqnr", f"{BLOCK}.down_proj")]
    assert down.details["unmeasured_experts"] == [UNREACHED] and "Not measured: expert(s) 2" in down.message
    # the checkpoint's expert_coverage item judges its weights: the pointer is to the gate's own batches
    assert "more or longer calibration batches" in down.message and "expert_coverage" not in down.message
