"""bitsandbytes artifacts as its users make them: transformers' from_pretrained with a BitsAndBytesConfig, 8-bit
(LLM.int8) and 4-bit NF4, on bitsandbytes' CPU backend."""
import pytest
import torch
from transformers import BitsAndBytesConfig

from qcore.artifact.layers import dequantized_weight
from qcore.artifact.tools import tool_layer_format
from tests.artifacts.checks import (
    assert_dequantized_as_computed,
    assert_fix_pastes,
    assert_gated_like_hooks,
    loaded_with,
    pasted_arguments,
)
from tests.helpers import FRAGILE_LAYER, fragile_llama, saved_llama, tiny_llama, token_batches, weight_sqnr_db

CONFIGS = {"int8": "load_in_8bit=True", "nf4": "load_in_4bit=True, bnb_4bit_quant_type='nf4'"}


@pytest.mark.parametrize("kind", CONFIGS)
def test_a_bitsandbytes_model_is_gated_with_its_own_dequantization(tmp_path, kind):
    reference = tiny_llama()
    quantized = loaded_with(saved_llama(reference, tmp_path / "float"), BitsAndBytesConfig, CONFIGS[kind])
    analysis = assert_gated_like_hooks(reference, quantized, token_batches(), "bitsandbytes",
                                       fmt="int8 per-channel" if kind == "int8" else "nf4 block 64")
    if kind == "int8":  # bitsandbytes' own: the int8 codes times each row's absmax over 127
        from bitsandbytes.functional import int8_vectorwise_dequant

        module = quantized.get_submodule(FRAGILE_LAYER)
        weight = int8_vectorwise_dequant(module.state.CB if module.weight.CB is None else module.weight.CB,
                                         module.state.SCB if module.weight.SCB is None else module.weight.SCB)
        expected = weight_sqnr_db(reference.get_submodule(FRAGILE_LAYER).weight, weight)
        assert analysis.sqnr.layers[FRAGILE_LAYER].weight_sqnr_db == pytest.approx(expected, abs=1e-4)
        assert 30 < expected < 60
    else:  # NF4 runs its layers on the dequantized weight: the same weight qcore reads
        layer = quantized.get_submodule(FRAGILE_LAYER)
        # on a CPU with AVX512-BF16 the layer computes in bfloat16 on a layout its first forward packed: one rounding
        packed = getattr(layer.weight.quant_state, "packing_format_for_cpu", False)
        assert_dequantized_as_computed(layer, tolerance=1e-2 if packed else 1e-4)
        assert 15 < analysis.sqnr.layers[FRAGILE_LAYER].weight_sqnr_db < 25


@pytest.mark.parametrize("double", [False, True])
def test_a_4bit_layer_packed_for_the_cpu_kernel_is_read_as_the_same_weight(tmp_path, double):
    """On a CPU with AVX512-BF16, a 4-bit layer's first forward repacks it (codes of 32 rows interleaved, absmax in
    bfloat16) and computes on that: the weight read from the packed layer is the one read before, to the bfloat16
    rounding of its absmax. Packed here as bitsandbytes packs it, on any CPU."""
    import copy

    from bitsandbytes.functional import _convert_weight_packed_for_cpu

    config = CONFIGS["nf4"] + (", bnb_4bit_use_double_quant=True" if double else "")
    quantized = loaded_with(saved_llama(tiny_llama(), tmp_path / "float"), BitsAndBytesConfig, config)
    layer = quantized.get_submodule(FRAGILE_LAYER)
    assert not getattr(layer.weight.quant_state, "packing_format_for_cpu", False)
    before, named = dequantized_weight(layer).float(), tool_layer_format(layer)
    assert named == "bitsandbytes nf4 block 64" + (" double-quantized" if double else "")
    layer.weight.data, layer.weight.quant_state = _convert_weight_packed_for_cpu(
        layer.weight.data.clone(), copy.deepcopy(layer.weight.quant_state))
    after = dequantized_weight(layer)
    assert after.shape == before.shape and after.dtype == torch.bfloat16
    torch.testing.assert_close(after.float(), before, rtol=2 ** -7, atol=0)
    assert weight_sqnr_db(before, after.float()) > 40
    assert tool_layer_format(layer) == named


@pytest.mark.parametrize("kind", CONFIGS)
def test_a_fragile_layer_is_caught_and_the_fix_in_llm_int8_skip_modules_passes(tmp_path, kind):
    folder = saved_llama(fragile_llama(), tmp_path / "float")

    def make(reference, line):
        return loaded_with(folder, BitsAndBytesConfig, pasted_arguments(line, BitsAndBytesConfig, CONFIGS[kind]))

    reference = fragile_llama()
    fix = assert_fix_pastes(reference, make, token_batches(), "bitsandbytes")
    assert fix.tool_line.startswith("BitsAndBytesConfig(..., llm_int8_skip_modules=['lm_head', ")
    if kind == "int8":
        assert fix.float_layers == (FRAGILE_LAYER,)
    assert isinstance(make(reference, fix.tool_line).get_submodule(fix.float_layers[0]), torch.nn.Linear)
