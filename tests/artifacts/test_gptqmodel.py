"""GPTQModel artifacts as its users make them: GPTQModel.load with a QuantizeConfig, quantize on calibration
batches, save, and GPTQModel.load of the saved checkpoint on the CPU (the wrapper it returns is declared as is)."""
import pytest
import torch
from gptqmodel import QuantizeConfig

from tests.artifacts.checks import (
    assert_dequantized_as_computed,
    assert_fix_pastes,
    assert_gated_like_hooks,
    pasted_arguments,
)
from tests.helpers import FRAGILE_LAYER, fragile_llama, gptq_artifact, tiny_llama, token_batches

CONFIG = "bits=4, group_size=32"


@pytest.fixture(scope="module")
def gptq_pair(tmp_path_factory):
    reference = tiny_llama()
    return reference, gptq_artifact(reference, tmp_path_factory.mktemp("gptq"), CONFIG)


def test_a_gptqmodel_checkpoint_is_gated_with_its_own_dequantization(gptq_pair):
    reference, quantized = gptq_pair
    layer = quantized.model.get_submodule(FRAGILE_LAYER)
    unpacked = layer.dequantize_weight().t().float()  # GPTQModel's own, before its CPU kernel repacks the weight
    analysis = assert_gated_like_hooks(reference, quantized, token_batches(), "gptqmodel", fmt="gptq int4 group 32")
    assert layer.linear_mode == "inference"  # repacked by the first forward: read through its fused matmul
    from qcore.artifact.layers import dequantized_weight

    assert torch.allclose(dequantized_weight(layer).float(), unpacked, rtol=0, atol=1e-2 * float(unpacked.abs().max()))
    assert_dequantized_as_computed(layer, tolerance=1e-2)
    assert 10 < analysis.sqnr.layers[FRAGILE_LAYER].weight_sqnr_db < 25


def test_a_fragile_layer_is_caught_and_the_fix_in_dynamic_passes(tmp_path):
    reference = fragile_llama()

    def make(model, line):
        folder = tmp_path / ("gptq" if line is None else "gptq-fixed")
        folder.mkdir()
        return gptq_artifact(model, folder, pasted_arguments(line, QuantizeConfig, CONFIG))

    fix = assert_fix_pastes(reference, make, token_batches(), "gptqmodel", calibrated=True)
    assert fix.tool_line.startswith("QuantizeConfig(..., dynamic={'-:")
