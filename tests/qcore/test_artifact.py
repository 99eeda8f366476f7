"""qcore.artifact: quantized models as torchao and compressed-tensors make them, measured against their float reference
by module name; every number against a direct computation with forward hooks on both models."""
import copy
import math
import sys

import pytest
import torch
from torch import nn
from torchao.quantization import Int8DynamicActivationInt8WeightConfig, Int8WeightOnlyConfig

from qcore.artifact import ArtifactAnalysis, ArtifactError, ArtifactMismatchError, state_digest
from tests.helpers import compressed_tensors_checkpoint, direct_layer_sqnr, tiny_llama, token_batches, torchao_artifact

LINEARS = [f"model.layers.{i}.{part}" for i in range(2) for part in (
    "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj",
    "mlp.down_proj")]


@pytest.fixture(scope="module")
def reference():
    return tiny_llama()


def _same_as_direct(reference, quantized, batches, names):
    analysis = ArtifactAnalysis(reference, quantized, batches, logits=True)
    assert [layer.name for layer in analysis.layers] == names
    direct, kl = direct_layer_sqnr(reference, quantized, names, batches)
    for name in names:
        assert analysis.sqnr.layers[name].sqnr_db == pytest.approx(direct[name], abs=0.05), name
    # the logits' log-softmax is taken in float32, as the logits are: below 1e-5 nats that resolution shows
    assert analysis.logits.kl_nats == pytest.approx(kl, rel=0.02, abs=1e-7)
    return analysis


@pytest.mark.parametrize("config", [Int8DynamicActivationInt8WeightConfig(), Int8WeightOnlyConfig()],
                         ids=["int8_dynamic", "int8_weight_only"])
def test_a_torchao_artifact_gets_every_quantized_layer_with_the_numbers_of_a_direct_computation(reference, config):
    quantized = torchao_artifact(reference, config)
    analysis = _same_as_direct(reference, quantized, token_batches(), LINEARS + ["lm_head"])
    assert analysis.layer("lm_head").format == "Int8Tensor"
    # the shadow runs the quantized layer on the reference's input: the first layer sees the reference's own input
    first = analysis.sqnr.layers["model.layers.0.self_attn.q_proj"]
    assert first.shadow_sqnr_db == pytest.approx(first.sqnr_db, abs=1e-6)
    assert 35 < first.weight_sqnr_db < 60 and not analysis.not_comparable
    for name in ("model.layers.0.self_attn.q_proj", "lm_head"):  # the dequantized weight against the reference's
        ours = quantized.get_submodule(name).weight.dequantize().double()
        theirs = reference.get_submodule(name).weight.detach().double()
        direct = 10 * math.log10(float((theirs**2).sum()) / float(((ours - theirs) ** 2).sum()))
        assert analysis.sqnr.layers[name].weight_sqnr_db == pytest.approx(direct, abs=1e-6)


def test_modules_whose_classes_were_imported_again_match_the_reference_by_class_name(reference, tmp_path,
                                                                                    monkeypatch):
    """A module imported again (pytester's in-process runs, an autoreload) makes the same class a new object: the
    artifact's modules still match the reference's, and only its quantized layers are named."""
    from transformers.models.auto import modeling_auto

    from qcore.artifact.layers import artifact_layers

    for name in [module for module in list(sys.modules) if module.startswith("transformers.models.llama")]:
        monkeypatch.delitem(sys.modules, name)
    # the auto classes keep the modules they loaded: a Llama loaded earlier in this process would be found there
    monkeypatch.setattr(modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING, "_modules", {})
    quantized = compressed_tensors_checkpoint(reference, tmp_path, "W8A8", None)
    assert type(quantized.model) is not type(reference.model)
    assert [layer.name for layer in artifact_layers(reference, quantized)] == LINEARS


@pytest.mark.parametrize("preset, group_size", [("W4A16", 32), ("W8A8", None)])
def test_a_compressed_tensors_checkpoint_loaded_with_transformers_is_measured_as_it_computes(reference, tmp_path,
                                                                                            preset, group_size):
    quantized = compressed_tensors_checkpoint(reference, tmp_path, preset, group_size)
    analysis = _same_as_direct(reference, quantized, token_batches(), LINEARS)  # lm_head is in its ignore list
    assert analysis.layer("model.layers.0.mlp.up_proj").format.startswith("compressed-tensors weights int")
    assert all(entry.weight_sqnr_db is not None for entry in analysis.sqnr.layers.values())


def test_an_nvfp4_checkpoint_decompressed_to_bf16_is_measured_against_its_float32_reference(reference, tmp_path):
    quantized = compressed_tensors_checkpoint(reference, tmp_path, "NVFP4")
    analysis = _same_as_direct(reference, quantized, token_batches(), LINEARS)
    assert quantized.get_submodule("model.layers.0.mlp.up_proj").weight.dtype == torch.bfloat16  # decompressed
    assert analysis.layer("model.layers.0.mlp.up_proj").format.startswith("compressed-tensors weights float")
    # FP4 values (E2M1) with FP8 group scales: far below int8's weight SQNR, and every layer's is measured
    assert all(10 < entry.weight_sqnr_db < 30 for entry in analysis.sqnr.layers.values())


def test_a_bf16_artifact_meets_its_float32_reference_in_float64(reference, tmp_path):
    quantized = torchao_artifact(reference, Int8WeightOnlyConfig()).to(torch.bfloat16)
    analysis = ArtifactAnalysis(reference, quantized, token_batches(2), logits=True)
    values = [entry.sqnr_db for entry in analysis.sqnr.layers.values()]
    assert all(math.isfinite(value) and value > 15 for value in values)
    assert analysis.logits.kl_nats < 0.01


def _smoothed(reference):
    """SmoothQuant by hand: per-channel scales folded into each input_layernorm and multiplied into q/k/v's input
    columns (the same function in float), then int8 weights."""
    model = copy.deepcopy(reference)
    generator = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for block in model.model.layers:
            scales = torch.rand(64, generator=generator) * 3.75 + 0.25
            block.input_layernorm.weight /= scales
            for projection in (block.self_attn.q_proj, block.self_attn.k_proj, block.self_attn.v_proj):
                projection.weight *= scales
    return torchao_artifact(model, Int8WeightOnlyConfig())


def test_a_smoothquant_artifact_says_the_shadow_of_its_rescaled_layers_is_not_comparable(reference):
    plain = ArtifactAnalysis(reference, torchao_artifact(reference, Int8WeightOnlyConfig()), token_batches(2))
    smoothed = ArtifactAnalysis(reference, _smoothed(reference), token_batches(2))
    rescaled = sorted(smoothed.not_comparable)
    assert rescaled == sorted(f"model.layers.{i}.self_attn.{p}_proj" for i in range(2) for p in "qkv")
    assert "model.layers.0.input_layernorm" in smoothed.not_comparable["model.layers.0.self_attn.q_proj"]
    for name in rescaled:
        assert math.isnan(smoothed.sqnr.layers[name].shadow_sqnr_db)
        # the weight is compared up to its input channels' scales (as is, it would be off by the scales: < 0 dB)
        assert 25 < smoothed.sqnr.layers[name].weight_sqnr_db < plain.sqnr.layers[name].weight_sqnr_db
    assert not math.isnan(smoothed.sqnr.layers["model.layers.0.self_attn.o_proj"].shadow_sqnr_db)


def test_a_layer_whose_input_channels_are_rescaled_while_no_norm_changed_is_measured_as_damaged(reference):
    """The weight fit alone is no evidence of SmoothQuant or AWQ: a layer damaged by per-channel scales (or a
    uniform one) with every norm as the reference's keeps its shadow and its own error, which shows the damage."""
    model = copy.deepcopy(reference)
    damaged = "model.layers.1.mlp.down_proj"
    with torch.no_grad():
        model.get_submodule(damaged).weight *= torch.rand(128, generator=torch.Generator().manual_seed(4)) + 0.5
        model.get_submodule("model.layers.0.mlp.up_proj").weight *= 0.1
    analysis = ArtifactAnalysis(reference, torchao_artifact(model, Int8WeightOnlyConfig()), token_batches(2))
    assert not analysis.not_comparable
    for name in (damaged, "model.layers.0.mlp.up_proj"):
        assert analysis.sqnr.layers[name].shadow_sqnr_db < 15  # the damage, measured as the layer's own error
        assert analysis.sqnr.layers[name].weight_sqnr_db < 15


def test_float_layers_swap_the_references_modules_in_and_restore_the_artifact(reference):
    quantized = torchao_artifact(reference, Int8DynamicActivationInt8WeightConfig())
    before = state_digest(quantized)
    analysis = ArtifactAnalysis(reference, quantized, token_batches(2),
                                float_layers=["model.layers.0.self_attn.q_proj"])
    assert analysis.sqnr.layers["model.layers.0.self_attn.q_proj"].sqnr_db == math.inf  # the reference's, exactly
    assert type(quantized.model.layers[0].self_attn.q_proj.weight).__name__ == "Int8Tensor"
    assert state_digest(quantized) == before
    swapped_all = ArtifactAnalysis(reference, quantized, token_batches(2), float_layers=LINEARS + ["lm_head"])
    assert swapped_all.sqnr.worst_output().sqnr_db == math.inf


def test_the_digest_follows_the_quantized_weights(reference, tmp_path):
    first = compressed_tensors_checkpoint(reference, tmp_path / "a", "W8A8")
    again = compressed_tensors_checkpoint(reference, tmp_path / "b", "W8A8")
    damaged = compressed_tensors_checkpoint(reference, tmp_path / "c", "W8A8", damaged="model.layers.1.mlp.up_proj")
    assert state_digest(first) == state_digest(again) != state_digest(damaged)


class _Mlp(nn.Module):
    def __init__(self, hidden=16, out=4):
        super().__init__()
        self.fc1, self.act, self.fc2 = nn.Linear(8, hidden), nn.ReLU(), nn.Linear(hidden, out)

    def forward(self, x):
        return self.fc2(self.act(self.fc1(x)))


def _mlp_pair(**changes):
    torch.manual_seed(0)
    reference = _Mlp().eval()
    quantized = torchao_artifact(reference, Int8WeightOnlyConfig())
    return reference, quantized


def test_a_quantized_model_of_another_architecture_lists_the_names_that_match_nothing(reference):
    other = torchao_artifact(tiny_llama(layers=3), Int8WeightOnlyConfig())
    with pytest.raises(ArtifactMismatchError, match=r"only in the quantized model \(\d+\): model\.layers\.2"):
        ArtifactAnalysis(reference, other)


def test_a_forward_that_raises_names_the_layer():
    reference, quantized = _mlp_pair()

    def broken(x):
        raise RuntimeError("kernel not available")

    quantized.fc2.forward = broken
    with pytest.raises(ArtifactError, match=r"raised RuntimeError in layer fc2: kernel not available\. Fix: .* "
                                            r"float_layers=\['fc2'\]"):
        ArtifactAnalysis(reference, quantized, [torch.randn(4, 8)]).sqnr  # noqa: B018


def test_outputs_of_another_structure_and_a_layer_of_another_shape_are_named():
    reference, quantized = _mlp_pair()
    tupled = nn.Module()
    tupled.fc1, tupled.act, tupled.fc2 = quantized.fc1, quantized.act, quantized.fc2
    tupled.forward = lambda x: {"scores": quantized(x)}
    with pytest.raises(ArtifactMismatchError, match="outputs differ in structure"):
        ArtifactAnalysis(reference, tupled, [torch.randn(4, 8)]).sqnr  # noqa: B018
    torch.manual_seed(1)
    wider = _Mlp(out=5).eval()
    wider.fc1 = quantized.fc1
    wider.fc2.weight.data.mul_(1.0001)
    with pytest.raises(ArtifactMismatchError, match=r"layer fc2: its output has shape \(4, 5\)"):
        ArtifactAnalysis(reference, wider, [torch.randn(4, 8)]).sqnr  # noqa: B018


def test_nan_in_the_artifacts_output_names_the_first_layer_that_produced_it():
    reference, quantized = _mlp_pair()
    nan_model = copy.deepcopy(reference)
    nan_model.fc1 = quantized.fc1
    with torch.no_grad():
        nan_model.fc2.weight[0, 0] = math.nan
    with pytest.raises(ArtifactError, match=r"output holds NaN; the first layer whose output holds NaN is fc2\. "
                                            r"Fix: .* float_layers=\['fc2'\]"):
        ArtifactAnalysis(reference, nan_model, [torch.randn(4, 8)]).sqnr  # noqa: B018


def test_an_artifact_no_tool_marked_is_gated_by_its_changed_weights_and_its_fix_offers_every_tools_line(reference):
    """Weights rounded by hand, no tool's marks: its layers are the modules whose weights changed, no tool is named,
    and the fix's recipe holds every tool's line (the message then points at the JSON's recipe)."""
    quantized = copy.deepcopy(reference)
    damaged = "model.layers.1.mlp.down_proj"
    with torch.no_grad():
        for name in LINEARS:
            weight = quantized.get_submodule(name).weight
            step = weight.abs().amax() / (7 if name == damaged else 127)
            weight.copy_(torch.round(weight / step) * step)
    analysis = ArtifactAnalysis(reference, quantized, token_batches(2), logits=True)
    assert [layer.name for layer in analysis.layers] == LINEARS and analysis.tool is None
    assert analysis.layer(damaged).format == "Linear with changed weights"
    before = analysis.sqnr.worst_output().sqnr_db
    fix = analysis.float_layers_fix(before + 3, "output_sqnr_db", 2)
    assert fix.reached and damaged in fix.float_layers and fix.tool is None and fix.tool_line is None
    assert set(fix.recipes) == {"float_layers", "llm-compressor", "modelopt", "bitsandbytes", "quanto", "hqq",
                                "gptqmodel", "torchao"}
