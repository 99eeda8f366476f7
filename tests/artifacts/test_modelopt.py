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


def _moe_quantized(model, data, name="FP8_DEFAULT_CFG", line=None):
    """A copy of the tiny MoE `model` quantized by ModelOpt with its config `name` (and the pasted fix `line`, which
    names `config`), calibrated on `data`: its fused experts quantized in place (`_QuantFusedExperts`)."""
    config = copy.deepcopy(getattr(mtq, name))
    if line is not None:
        exec(line, {"config": config})
    return mtq.quantize(copy.deepcopy(model), config, lambda m: [m(**batch) for batch in data]).eval()


def test_a_moe_models_fused_experts_are_read_through_modelopts_per_expert_weight_quantizers():
    """ModelOpt quantizes transformers 5's fused experts in place (`_QuantFusedExperts`: the float 3-D parameters
    kept, one weight quantizer per expert and one input quantizer per projection): each expert's projection is a
    layer that computes as ModelOpt's forward does (the model's output to the bit), measured and named as its item
    names it (`mlp.experts.gate_up_proj`, `mlp.experts.down_proj`), and an expert whose quantizer holds a NaN amax
    (ModelOpt's uncalibrated experts, its issue #1354) is named."""
    from tests.models import tiny_moe

    model, data = tiny_moe("qwen3_moe", experts=4)
    model.set_experts_implementation("eager")  # the implementation ModelOpt intercepts
    quantized = _moe_quantized(model, data)
    block = "model.layers.0.mlp.experts"
    experts = quantized.get_submodule(block)
    analysis = ArtifactAnalysis(model, quantized, data)
    with torch.no_grad():
        assert all(torch.equal(quantized(**batch).logits, analysis.quantized(**batch).logits) for batch in data)
    layers = {f"{block}.{e}.{name}" for e in range(4) for name in ("gate_up_proj", "down_proj")}
    names = {layer.name for layer in analysis.layers}
    assert layers <= names and block not in names  # the experts, not the block that holds ModelOpt's quantizers
    assert {layer: entry.projection for layer, entry in analysis.expert_layers.items()} == {
        layer: f"{block}.{layer.rsplit('.', 1)[1]}" for layer in layers}
    assert analysis.layer(f"{block}.1.down_proj").format == "ModelOpt inputs fp8 e4m3 per-tensor, weights fp8 e4m3 " \
                                                            "per-tensor"  # as its quantized Linear's
    # each expert's own error: its routed reference tokens through ModelOpt's input and weight quantizers
    reference_experts = model.get_submodule(block)
    for layer in layers:
        expert, name = int(layer.split(".")[-2]), layer.rsplit(".", 1)[1]
        weight = getattr(reference_experts, name)[expert].detach()
        with torch.no_grad():
            computed = getattr(experts, f"{name}_weight_quantizers")[expert](getattr(experts, name)[expert])
        assert analysis.sqnr.layers[layer].weight_sqnr_db == pytest.approx(float(compute_sqnr(weight, computed)),
                                                                           abs=1e-3), layer
        assert 20 < analysis.sqnr.layers[layer].sqnr_db < 40, layer  # FP8 inputs and weights: quantized
    found = analysis.checkpoint_experts[block]
    for name in ("gate_up_proj", "down_proj"):
        for expert in range(4):
            assert found.weight_sqnr_db[name][expert] == pytest.approx(
                analysis.sqnr.layers[f"{block}.{expert}.{name}"].weight_sqnr_db, abs=1e-3), (name, expert)
    with torch.no_grad():
        experts.down_proj_weight_quantizers[1].amax = torch.tensor(float("nan"))
    damaged = ArtifactAnalysis(model, quantized, data)
    assert damaged.checkpoint_experts[block].non_finite == (1,)
    # the NaN reaches the output from the expert's layer, which the error names
    with pytest.raises(ArtifactError, match=r"holds NaN is model\.layers\.0\.mlp\.experts\.1\.down_proj\. Fix"):
        _ = damaged.sqnr  # measured when first read


def test_a_fused_experts_fix_is_the_experts_weight_quantizers_and_measures_what_pasting_it_gives():
    """Keeping a ModelOpt fused expert in float is turning its weight quantizer off (its projection's input quantizer
    is every expert's): the trial keeps the input quantized, and the printed quant_cfg entry names that expert's
    weight quantizer alone, whose pasted model measures the fix's number."""
    from tests.helpers import output_sqnr_db
    from tests.models import tiny_moe

    model, data = tiny_moe("qwen3_moe", experts=4)
    model.set_experts_implementation("eager")
    block = "model.layers.0.mlp.experts"
    with torch.no_grad():  # one input channel of expert 2's down_proj far out: its int8 rows lose the others
        model.get_submodule(block).down_proj[2, :, 5] *= 400.0
    analysis = ArtifactAnalysis(model, _moe_quantized(model, data, "INT8_DEFAULT_CFG"), data, logits=True)
    layers = analysis.sqnr.layers
    assert min(layers, key=lambda layer: layers[layer].sqnr_db) == f"{block}.2.down_proj"
    before = output_sqnr_db(model, analysis.quantized, data)
    fix = analysis.float_layers_fix(before + 2.0, "output_sqnr_db", 3)
    assert fix.reached and f"{block}.2.down_proj" in fix.float_layers, fix
    assert f"{{'quantizer_name': '*{block}.down_proj_weight_quantizers.2', 'enable': False}}" in fix.tool_line
    pasted = _moe_quantized(model, data, "INT8_DEFAULT_CFG", fix.tool_line)
    off = [name for name, module in pasted.named_modules() if hasattr(module, "is_enabled") and not module.is_enabled
           and name.startswith(block)]
    assert off == [f"{block}.down_proj_weight_quantizers.2"]
    assert output_sqnr_db(model, pasted, data) == pytest.approx(fix.measured, abs=0.05)
    assert fix.measured >= before + 2.0


def test_the_fused_experts_wildcards_match_exactly_the_quantizers_of_the_experts_named():
    """A projection's experts (`block.*.down_proj`), a block's (`block`) and one expert's (`block.3.down_proj`, not
    `block.30`'s) are written as ModelOpt's wildcards over the per-expert weight quantizers they stand for, as
    ModelOpt matches them (fnmatch, on the name and on its name without the expert's index)."""
    import fnmatch
    import re

    from modelopt.torch.quantization.conversion import _normalize_fused_experts_quantizer_name

    from qcore.artifact import tool_recipes
    from tests.models import tiny_moe

    model, data = tiny_moe("qwen3_moe", experts=32)
    model.set_experts_implementation("eager")
    quantized = _moe_quantized(model, data[:1])
    block = "model.layers.0.mlp.experts"
    quantizers = [name for name, module in quantized.named_modules() if hasattr(module, "is_enabled")]

    def matched(glob):
        line = tool_recipes([glob], patterns=[glob], per_expert_blocks=[block])["modelopt"]
        wildcard = re.findall(r"'quantizer_name': '([^']+)'", line)[0]
        return {name for name in quantizers if fnmatch.fnmatch(name, wildcard)
                or fnmatch.fnmatch(_normalize_fused_experts_quantizer_name(name), wildcard)}

    weights = {name: f"{block}.{name}_weight_quantizers" for name in ("gate_up_proj", "down_proj")}
    assert matched(f"{block}.3.down_proj") == {f"{weights['down_proj']}.3"}
    assert matched(f"{block}.*.down_proj") == {f"{weights['down_proj']}.{e}" for e in range(32)}
    assert matched(block) == {f"{weights[name]}.{e}" for name in weights for e in range(32)}
    assert matched("model.layers.0.self_attn.o_proj") == {f"model.layers.0.self_attn.o_proj.{kind}_quantizer"
                                                          for kind in ("input", "output", "weight")}


def test_the_gate_names_a_modelopt_fused_projections_items_by_its_parameter_and_its_worst_expert():
    """In the plugin's run, a ModelOpt MoE checkpoint's experts get one sqnr and one weight_sqnr item per projection
    (none for the block as one layer), each naming its worst experts, and the output gate's fix says that the
    experts it keeps in float keep their shared input quantizer, in the words of the line it prints."""
    from pytest_qreport.checks import BUILTIN_CHECKS
    from pytest_qreport.core.pipeline import collect_model
    from pytest_qreport.core.settings import ModelSettings
    from tests.helpers import builtin_registry
    from tests.models import tiny_moe

    model, data = tiny_moe("qwen3_moe", experts=4)
    model.set_experts_implementation("eager")
    block = "model.layers.0.mlp.experts"
    with torch.no_grad():
        model.get_submodule(block).down_proj[2, :, 5] *= 400.0
    quantized = _moe_quantized(model, data, "INT8_DEFAULT_CFG")
    settings = ModelSettings.defaults(BUILTIN_CHECKS, calibration=data, quantized=lambda: quantized,
                                      checks=["sqnr", "weight_sqnr", "expert_coverage", "model_sqnr",
                                              "routing_agreement"])
    pipeline = collect_model("m", settings, builtin_registry(), None, model, data[0], quantized=quantized)
    pipeline.analyze(lambda: data, lambda found: None)
    found = pipeline.findings
    items = {(check, layer) for check, layer in found if check in ("sqnr", "weight_sqnr")}
    assert {(check, layer) for check, layer in items if layer.startswith(block)} == {
        (check, f"{block}.{name}") for check in ("sqnr", "weight_sqnr") for name in ("gate_up_proj", "down_proj")}
    down = found["sqnr", f"{block}.down_proj"]
    assert down.message.startswith(f"{block}.down_proj: 4 experts, 0 failing; judged on expert 2; worst: 2 (")
    assert found["expert_coverage", block].verdict == "pass"
    output = found["model_sqnr", "output"]
    assert "keep their projection's input quantizer" in output.message
    assert f"'*{block}.down_proj_weight_quantizers." in output.message
    routing = found["routing_agreement", "model"]  # not measured here, saying why in its own words
    assert routing.verdict == "skip" and "a router it quantized is a layer of the artifact" in routing.message
