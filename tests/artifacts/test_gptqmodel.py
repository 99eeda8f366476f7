"""GPTQModel artifacts as its users make them: GPTQModel.load with a QuantizeConfig, quantize on calibration
batches, save, and GPTQModel.load of the saved checkpoint on the CPU (the wrapper it returns is declared as is)."""
import contextlib
import os

import pytest
import torch

from tests.artifacts.checks import (
    assert_dequantized_as_computed,
    assert_fix_pastes,
    assert_gated_like_hooks,
    pasted_arguments,
)
from tests.helpers import FRAGILE_LAYER, fragile_llama, saved_llama, tiny_llama, token_batches

os.environ.setdefault("GPTQMODEL_CPU_WORKERS", "2")
CONFIG = "bits=4, group_size=32"


def _gptq(reference, folder, line=None):
    """`reference` quantized by GPTQModel with QuantizeConfig(CONFIG) (or the pasted line), saved and loaded back."""
    from gptqmodel import GPTQModel, QuantizeConfig

    source = saved_llama(reference, folder / "float")
    arguments = pasted_arguments(line, QuantizeConfig, CONFIG)
    config = eval(f"QuantizeConfig({arguments})", {"QuantizeConfig": QuantizeConfig})
    calibration = [{"input_ids": ids.unsqueeze(0), "attention_mask": torch.ones_like(ids).unsqueeze(0)}
                   for batch in token_batches(8) for ids in batch["input_ids"]]
    target = folder / ("gptq" if line is None else "gptq-fixed")
    with contextlib.chdir(folder):  # its quantization log goes to ./logs
        model = GPTQModel.load(str(source), config, device="cpu")
        model.quantize(calibration, batch_size=1)
        model.save(str(target))
    return GPTQModel.load(str(target), device="cpu")


@pytest.fixture(scope="module")
def gptq_pair(tmp_path_factory):
    reference = tiny_llama()
    return reference, _gptq(reference, tmp_path_factory.mktemp("gptq"))


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
    fix = assert_fix_pastes(reference, lambda model, line: _gptq(model, tmp_path, line), token_batches(), "gptqmodel")
    assert fix.tool_line.startswith("QuantizeConfig(..., dynamic={'-:")
