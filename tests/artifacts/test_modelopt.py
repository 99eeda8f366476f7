"""NVIDIA ModelOpt artifacts as its users make them: mtq.quantize with its own configs and a calibration loop,
mto.save / mto.restore, and mtq.disable_quantizer; the fix is a quant_cfg entry in the installed version's format."""
import copy

import modelopt.torch.opt as mto
import modelopt.torch.quantization as mtq
import pytest
import torch

from qcore.artifact import ArtifactAnalysis, ArtifactError
from qcore.numeric import compute_sqnr
from tests.artifacts.checks import assert_dequantized_as_computed, assert_fix_pastes, assert_gated_like_hooks
from tests.helpers import FRAGILE_LAYER, TINY_LLAMA_LINEARS, fragile_llama, tiny_llama, token_batches

FORMATS = {"INT8_DEFAULT_CFG": "weights int8 per-channel", "INT8_SMOOTHQUANT_CFG": "inputs pre-scaled",
           "FP8_DEFAULT_CFG": "weights fp8 e4m3 per-tensor", "INT4_AWQ_CFG": "weights int4 block 128"}


def _quantized(reference, name, line=None, extra=()):
    """`reference` copied and quantized with ModelOpt's config `name` (plus `extra` quant_cfg entries, and the
    pasted fix `line`, which names `config`), calibrated on token_batches."""
    config = copy.deepcopy(getattr(mtq, name))
    config["quant_cfg"] = config["quant_cfg"] + list(extra)
    if line is not None:
        exec(line, {"config": config})

    def calibrate(model):
        with torch.no_grad():
            for batch in token_batches():
                model(**batch)

    return mtq.quantize(copy.deepcopy(reference), config, calibrate).eval()


@pytest.mark.parametrize("name", FORMATS)
def test_a_modelopt_model_is_gated_layer_by_layer_with_its_quantizers_dequantization(name):
    reference = tiny_llama()
    quantized = _quantized(reference, name)
    analysis = assert_gated_like_hooks(reference, quantized, token_batches(), "modelopt", fmt=FORMATS[name])
    layer = quantized.get_submodule(FRAGILE_LAYER)
    layer.input_quantizer.disable()  # the weight path alone (a pre_quant_scale still applies)
    try:
        assert_dequantized_as_computed(layer)
    finally:
        if name != "INT4_AWQ_CFG":
            layer.input_quantizer.enable()
    assert analysis.sqnr.layers[FRAGILE_LAYER].weight_sqnr_db > 15


def test_kv_cache_quantizers_make_the_attention_a_layer_with_its_projections():
    reference = tiny_llama()
    quantized = _quantized(reference, "FP8_DEFAULT_CFG", extra=copy.deepcopy(mtq.FP8_KV_CFG["quant_cfg"]))
    attention = [f"model.layers.{i}.self_attn" for i in range(2)]
    layers = sorted(TINY_LLAMA_LINEARS + attention, key=[name for name, _ in reference.named_modules()].index)
    analysis = assert_gated_like_hooks(reference, quantized, token_batches(), "modelopt", layers=layers)
    assert analysis.layer(attention[0]).format == "ModelOpt k bmm fp8 e4m3 per-tensor, v bmm fp8 e4m3 per-tensor"
    assert all(analysis.sqnr.layers[name].sqnr_db < 60 for name in attention)


def test_modules_whose_quantizers_are_all_off_and_modelopt_bookkeeping_are_no_layers():
    reference = tiny_llama()
    quantized = _quantized(reference, "INT8_DEFAULT_CFG")
    assert type(quantized.lm_head).__name__ == "QuantLinear" and "_shared_quant_states" in dict(
        quantized.model.layers[0].mlp.named_children())
    names = [layer.name for layer in ArtifactAnalysis(reference, quantized).layers]
    assert names == TINY_LLAMA_LINEARS  # no lm_head, embed_tokens or self_attn: their quantizers are off


def test_a_model_saved_with_mto_save_and_restored_is_gated(tmp_path):
    reference = tiny_llama()
    mto.save(_quantized(reference, "INT8_DEFAULT_CFG"), tmp_path / "modelopt.pth")
    restored = mto.restore(copy.deepcopy(reference), tmp_path / "modelopt.pth")
    assert_gated_like_hooks(reference, restored, token_batches(), "modelopt", fmt=FORMATS["INT8_DEFAULT_CFG"])


@pytest.mark.parametrize("name", ["INT8_DEFAULT_CFG", "INT4_AWQ_CFG"])
def test_a_fragile_layer_is_caught_and_the_quant_cfg_entry_passes(name):
    reference = fragile_llama()
    fix = assert_fix_pastes(reference, lambda model, line: _quantized(model, name, line), token_batches(), "modelopt")
    assert fix.tool_line.startswith("config['quant_cfg'].extend([{'quantizer_name': '*model.layers.")
    if name == "INT8_DEFAULT_CFG":
        assert fix.float_layers == (FRAGILE_LAYER,)
        # the same layers off with mtq.disable_quantizer after quantizing measure the fix's number
        quantized = _quantized(reference, name)
        mtq.disable_quantizer(quantized, f"*{FRAGILE_LAYER}*")
        from tests.helpers import output_sqnr_db

        assert output_sqnr_db(reference, quantized, token_batches()) == pytest.approx(fix.measured, abs=0.05)


def test_a_moe_models_fused_experts_are_read_through_modelopts_per_expert_weight_quantizers():
    """ModelOpt quantizes transformers 5's fused experts in place (`_QuantFusedExperts`: the float 3-D parameters
    kept, one weight quantizer per expert): each expert is read as its quantizer gives it, and an expert whose
    quantizer holds a NaN amax (ModelOpt's uncalibrated experts, its issue #1354) is named."""
    from tests.models import tiny_moe

    model, data = tiny_moe("qwen3_moe", experts=4)
    model.set_experts_implementation("eager")  # the implementation ModelOpt intercepts
    config = copy.deepcopy(mtq.FP8_DEFAULT_CFG)
    quantized = mtq.quantize(copy.deepcopy(model), config, lambda m: [m(**batch) for batch in data]).eval()
    block = "model.layers.0.mlp.experts"
    experts = quantized.get_submodule(block)
    with torch.no_grad():
        experts.down_proj_weight_quantizers[1].amax = torch.tensor(float("nan"))
    analysis = ArtifactAnalysis(model, quantized, data)
    found = analysis.checkpoint_experts[block]
    # the NaN reaches the output through the block, which the comparison measures whole: the error points at the
    # item that names the expert
    with pytest.raises(ArtifactError, match=r"holds NaN is model\.layers\.0\.mlp\.experts, an MoE block's experts: "
                                            r"its expert_coverage item names each expert whose weights hold NaN"):
        _ = analysis.sqnr  # measured when first read
    reference = model.get_submodule(block)
    for name in ("gate_up_proj", "down_proj"):
        for expert in (0, 2, 3):
            with torch.no_grad():
                computed = getattr(experts, f"{name}_weight_quantizers")[expert](getattr(experts, name)[expert])
            expected = float(compute_sqnr(getattr(reference, name)[expert].detach(), computed))
            assert found.weight_sqnr_db[name][expert] == pytest.approx(expected, abs=1e-3), (name, expert)
            assert 20 < expected < 40  # FP8 per tensor: quantized, not the float parameter it keeps
    assert found.non_finite == (1,)
