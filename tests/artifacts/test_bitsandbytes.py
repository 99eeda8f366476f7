"""bitsandbytes artifacts as its users make them: transformers' from_pretrained with a BitsAndBytesConfig, 8-bit
(LLM.int8) and 4-bit NF4, on bitsandbytes' CPU backend."""
import pytest
import torch
from transformers import BitsAndBytesConfig

from tests.artifacts.checks import (
    assert_dequantized_as_computed,
    assert_fix_pastes,
    assert_gated_like_hooks,
    loaded_with,
    pasted_arguments,
)
from tests.helpers import FRAGILE_LAYER, fragile_llama, saved_llama, tiny_llama, token_batches

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
        from tests.helpers import weight_sqnr_db

        expected = weight_sqnr_db(reference.get_submodule(FRAGILE_LAYER).weight, weight)
        assert analysis.sqnr.layers[FRAGILE_LAYER].weight_sqnr_db == pytest.approx(expected, abs=1e-4)
        assert 30 < expected < 60
    else:  # NF4 runs its layers on the dequantized weight: the same weight qcore reads
        assert_dequantized_as_computed(quantized.get_submodule(FRAGILE_LAYER))
        assert 15 < analysis.sqnr.layers[FRAGILE_LAYER].weight_sqnr_db < 25


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
