"""torchao artifacts made with quantize_ as its users call it: the fix is a filter_fn that keeps in float what the
artifact's own filter kept, and the layers the fix names."""
import copy

import pytest
import torch
from torchao.quantization import Int8WeightOnlyConfig, quantize_

from tests.artifacts.checks import assert_fix_pastes
from tests.helpers import FRAGILE_LAYER, fragile_llama, token_batches


@pytest.mark.parametrize("head_in_float", [True, False])
def test_the_filter_fn_fix_keeps_what_the_artifacts_filter_kept_and_passes_when_pasted(head_in_float):
    def make(reference, line):
        model, config = copy.deepcopy(reference), Int8WeightOnlyConfig()
        if line is None:
            quantize_(model, config, filter_fn=lambda module, fqn: isinstance(module, torch.nn.Linear) and not (
                head_in_float and fqn == "lm_head"))
        else:
            exec(line, {"quantize_": quantize_, "model": model, "config": config, "torch": torch})  # as printed
        return model

    fix = assert_fix_pastes(fragile_llama(), make, token_batches(), "torchao")
    kept = ["lm_head", FRAGILE_LAYER] if head_in_float else [FRAGILE_LAYER]
    assert fix.float_layers == (FRAGILE_LAYER,) and fix.tool_line == (
        "quantize_(model, config, filter_fn=lambda module, fqn: isinstance(module, torch.nn.Linear) and fqn not in "
        f"{sorted(kept)!r})")
