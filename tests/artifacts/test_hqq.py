"""HQQ artifacts as its users make them: hqq's AutoHQQHFModel.quantize_model on a transformers model (transformers'
HqqConfig raises NotImplementedError("QuantizationMethod.HQQ is not available yet") with transformers 5.24)."""
import copy

import pytest
import torch

from tests.artifacts.checks import assert_dequantized_as_computed, assert_fix_pastes, assert_gated_like_hooks
from tests.helpers import FRAGILE_LAYER, fragile_llama, hqq_artifact, tiny_llama, token_batches


def _quantized(reference, line=None):
    model = hqq_artifact(reference)
    if line is not None:  # pasted as printed: it names `model` and `float_model`, the model before quantize_model
        exec(line, {"model": model, "float_model": copy.deepcopy(reference)})
    return model.eval()


def test_an_hqq_model_is_gated_with_its_own_dequantization():
    reference = tiny_llama()
    quantized = _quantized(reference)
    analysis = assert_gated_like_hooks(reference, quantized, token_batches(), "hqq", fmt="hqq int4 group 64 axis 1")
    assert_dequantized_as_computed(quantized.get_submodule(FRAGILE_LAYER))
    assert 15 < analysis.sqnr.layers[FRAGILE_LAYER].weight_sqnr_db < 25


def test_a_fragile_layer_is_caught_and_the_fix_pasted_after_quantize_model_passes():
    reference = fragile_llama()
    fix = assert_fix_pastes(reference, _quantized, token_batches(), "hqq")
    fixed = _quantized(reference, fix.tool_line)
    assert all(type(fixed.get_submodule(name)) is torch.nn.Linear for name in fix.float_layers)


def test_the_hf_config_path_is_what_transformers_refuses_here(tmp_path):
    """Where transformers takes HqqConfig, its models are HQQLinear layers as above; this one refuses it."""
    from transformers import AutoModelForCausalLM, HqqConfig

    tiny_llama().save_pretrained(tmp_path)
    with pytest.raises(NotImplementedError, match="HQQ is not available"):
        AutoModelForCausalLM.from_pretrained(tmp_path, quantization_config=HqqConfig(nbits=4, group_size=64))
