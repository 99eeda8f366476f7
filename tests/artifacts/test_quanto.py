"""optimum-quanto artifacts as its users make them: transformers' QuantoConfig (int8, int4 weights), and quanto's own
quantize + freeze."""
import ast
import copy
import re

import pytest
import torch
from transformers import QuantoConfig

from tests.artifacts.checks import (
    assert_dequantized_as_computed,
    assert_fix_pastes,
    assert_gated_like_hooks,
    loaded_with,
    pasted_arguments,
)
from tests.helpers import FRAGILE_LAYER, fragile_llama, saved_llama, tiny_llama, token_batches

CONFIGS = {"int8": "weights='int8'", "int4": "weights='int4'"}


@pytest.mark.parametrize("kind", CONFIGS)
def test_a_quanto_model_is_gated_with_its_own_dequantization(tmp_path, kind):
    reference = tiny_llama()
    quantized = loaded_with(saved_llama(reference, tmp_path / "float"), QuantoConfig, CONFIGS[kind])
    analysis = assert_gated_like_hooks(reference, quantized, token_batches(), "quanto",
                                       fmt=f"quanto weights q{kind} per-channel")
    assert_dequantized_as_computed(quantized.get_submodule(FRAGILE_LAYER))
    low, high = (35, 60) if kind == "int8" else (15, 25)
    assert low < analysis.sqnr.layers[FRAGILE_LAYER].weight_sqnr_db < high


def test_a_model_quantized_and_frozen_with_quanto_itself_is_gated():
    from optimum.quanto import freeze, qint8, quantize

    reference = tiny_llama()
    quantized = copy.deepcopy(reference)
    quantize(quantized, weights=qint8, exclude=["lm_head"])
    freeze(quantized)
    assert_gated_like_hooks(reference, quantized, token_batches(), "quanto", fmt="quanto weights qint8")


@pytest.mark.parametrize("excluded", [[], ["lm_head"]], ids=["everything", "lm_head_excluded"])
def test_a_model_quantized_with_quanto_itself_gets_its_fix_as_that_calls_exclude(excluded):
    """quantize(model, weights=qint8) quantizes lm_head too: the fix is quantize's own exclude, naming what that call
    left in float and the layer to keep, and nothing else (QuantoConfig's list would keep lm_head in float too)."""
    from optimum.quanto import freeze, qint8, quantize

    def make(reference, line):
        model = copy.deepcopy(reference)
        exclude = list(excluded) if line is None else ast.literal_eval(re.search(r"exclude=(\[.*\])\)$", line).group(1))
        quantize(model, weights=qint8, exclude=exclude)
        freeze(model)
        return model

    fix = assert_fix_pastes(fragile_llama(), make, token_batches(), "quanto")
    assert fix.float_layers == (FRAGILE_LAYER,)
    assert fix.tool_line == f"quantize(model, weights=qint8, exclude={[*excluded, FRAGILE_LAYER]!r})"
    fixed = make(fragile_llama(), fix.tool_line)
    assert type(fixed.get_submodule(FRAGILE_LAYER)) is torch.nn.Linear
    assert (type(fixed.lm_head) is torch.nn.Linear) == bool(excluded)  # no other layer changes


@pytest.mark.parametrize("kind", CONFIGS)
def test_a_fragile_layer_is_caught_and_the_fix_in_modules_to_not_convert_passes(tmp_path, kind):
    folder = saved_llama(fragile_llama(), tmp_path / "float")

    def make(reference, line):
        return loaded_with(folder, QuantoConfig, pasted_arguments(line, QuantoConfig, CONFIGS[kind]))

    reference = fragile_llama()
    fix = assert_fix_pastes(reference, make, token_batches(), "quanto")
    assert fix.float_layers == (FRAGILE_LAYER,)
    assert fix.tool_line == f"QuantoConfig(..., modules_to_not_convert=['lm_head', {FRAGILE_LAYER!r}])"
    assert type(make(reference, fix.tool_line).get_submodule(FRAGILE_LAYER)) is torch.nn.Linear


def _artifact_findings(reference, quantized, batches, **settings):
    """{(check, layer): Finding} of an artifact as the plugin judges it, in this process."""
    from pytest_qreport.checks import BUILTIN_CHECKS
    from pytest_qreport.core.pipeline import collect_model
    from pytest_qreport.core.settings import ModelSettings
    from tests.helpers import builtin_registry

    resolved = ModelSettings.defaults(BUILTIN_CHECKS, calibration=batches, quantized=quantized, **settings)
    pipeline = collect_model("m", resolved, builtin_registry(), None, reference, None, quantized)
    pipeline.analyze(lambda: batches, lambda found: None)
    assert pipeline.findings is not None, pipeline.error
    return pipeline.findings


def test_a_wider_float_layers_search_is_advised_only_as_measured_and_pasted_it_searches_further():
    """Short of a high model_sqnr target, the message names a wider search only with what keeping that many layers
    in float at once was measured to give; pasted, the search goes further than before (not the same 8 layers)."""
    from optimum.quanto import freeze, qint8, quantize

    reference, batches = tiny_llama(), token_batches()
    quantized = copy.deepcopy(reference)
    quantize(quantized, weights=qint8)
    freeze(quantized)
    settings = {"checks": ["model_sqnr"], "model_sqnr_min_db": 50.0, "fix_budget": float("inf")}
    message = _artifact_findings(reference, quantized, batches, **settings)[("model_sqnr", "output")].message
    advised = re.search(r"keeping the (\d+) with the largest own error in float at once measures ([\d.]+) dB on the "
                        r"first 2 batch\(es\): search among them with qmodel\((check_options=\{.*?\}\})\)", message)
    assert advised and float(advised.group(2)) >= 50.0, message
    before = float(re.search(r"the best found was measured at ([\d.]+) dB", message).group(1))
    options = ast.literal_eval(advised.group(3).removeprefix("check_options="))
    after = _artifact_findings(reference, quantized, batches, check_options=options, **settings)
    pasted = after[("model_sqnr", "output")].message
    found = re.search(r"(?:the best found was measured at|was measured to reach) ([\d.]+) dB", pasted)
    measured = float(found.group(1))
    assert measured > before and "No set of up to 8 layer(s)" not in pasted, pasted
