"""What every tool's artifact test asserts: the quantized layers the tool made, numbers equal to forward hooks on
both models, each layer's weight dequantized as the layer computes with it, and a fix in the tool's words that,
pasted into the tool, passes."""
import pytest
import torch
import torch.nn.functional as F

from qcore.artifact import ArtifactAnalysis
from qcore.artifact.layers import dequantized_weight
from tests.helpers import TINY_LLAMA_LINEARS, direct_layer_sqnr, output_sqnr_db, weight_sqnr_db


def assert_gated_like_hooks(reference, quantized, batches, tool, layers=TINY_LLAMA_LINEARS, fmt=""):
    """The artifact's layers are `layers` (made by `tool`, their format naming `fmt`), each layer's SQNR is the one
    forward hooks on both models give (0.05 dB), the KL the logits give, and its weight SQNR the one of the weight
    it computes with."""
    analysis = ArtifactAnalysis(reference, quantized, batches, logits=True)
    assert [layer.name for layer in analysis.layers] == layers
    assert analysis.tool == tool and all(fmt in layer.format for layer in analysis.layers), analysis.layers[0]
    linears = [name for name in layers if isinstance(reference.get_submodule(name), torch.nn.Linear)]
    direct, kl = direct_layer_sqnr(reference, analysis.quantized, linears, batches)
    for name in linears:
        assert analysis.sqnr.layers[name].sqnr_db == pytest.approx(direct[name], abs=0.05), name
    assert analysis.logits.kl_nats == pytest.approx(kl, rel=0.02, abs=1e-7)
    assert not analysis.not_comparable  # no norm changed: nothing is called rescaled
    for name in linears:
        ours = dequantized_weight(analysis.quantized.get_submodule(name))
        expected = weight_sqnr_db(reference.get_submodule(name).weight, ours)
        assert analysis.sqnr.layers[name].weight_sqnr_db == pytest.approx(expected, abs=1e-6), name
    return analysis


def assert_dequantized_as_computed(module, tolerance=1e-4):
    """The layer's own forward on a random input equals a float linear with the weight qcore dequantized (the
    tool's weight-only path: an input quantizer, where the layer has one, is off for the check)."""
    ours = dequantized_weight(module)
    assert ours is not None and torch.isfinite(ours).all()
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(3, ours.shape[1], generator=generator).to(ours.dtype)
    bias = getattr(module, "bias", None)
    with torch.no_grad():
        expected = F.linear(x, ours, bias.to(ours.dtype) if isinstance(bias, torch.Tensor) else None)
        actual = module(x).to(expected.dtype)
    scale = float(expected.abs().max())
    assert float((actual - expected).abs().max()) <= tolerance * scale, (actual - expected).abs().max()


def assert_fix_pastes(reference, make, batches, tool, margin_db=2.0, calibrated=False):
    """The fix searched for an output SQNR `margin_db` above the artifact's names `tool`'s words, and the artifact
    the tool makes with that line pasted (`make(reference, line)`) reaches the target, changing only the layers
    the fix names: they are in float, every other layer is quantized as before (the same dequantized weight,
    unless the tool is `calibrated` on the outputs of the layers before, as GPTQ is). Returns the fix."""
    quantized = make(reference, None)
    analysis = ArtifactAnalysis(reference, quantized, batches, logits=True)
    before = output_sqnr_db(reference, analysis.quantized, batches)
    target = before + margin_db
    fix = analysis.float_layers_fix(target, "output_sqnr_db", 3)
    assert fix.reached and fix.tool == tool and fix.tool_line, fix
    fixed = make(reference, fix.tool_line)
    pasted = ArtifactAnalysis(reference, fixed, batches)
    measured = output_sqnr_db(reference, pasted.quantized, batches)
    assert measured >= target, (fix.tool_line, measured, target)
    was = {layer.name: dequantized_weight(analysis.quantized.get_submodule(layer.name)) for layer in analysis.layers}
    now = {layer.name: dequantized_weight(pasted.quantized.get_submodule(layer.name)) for layer in pasted.layers}
    assert sorted(set(was) - set(now)) == sorted(fix.float_layers) and set(now) <= set(was), fix.tool_line
    if not calibrated:
        assert [name for name in now if not torch.equal(now[name], was[name])] == [], fix.tool_line
    return fix


def loaded_with(folder, config_class, arguments):
    """The checkpoint at `folder` loaded by transformers on the CPU with `config_class(<arguments>)`, the config's
    keyword arguments as written in Python (as a user pastes them)."""
    from transformers import AutoModelForCausalLM

    name = config_class.__name__
    config = eval(f"{name}({arguments})", {name: config_class})
    return AutoModelForCausalLM.from_pretrained(folder, quantization_config=config, device_map="cpu").eval()


def pasted_arguments(line, config_class, arguments):
    """The arguments of a printed `Config(..., key=value)` line, its `...` standing for `arguments` (`arguments`
    alone when there is no line)."""
    if line is None:
        return arguments
    return line.removeprefix(f"{config_class.__name__}(").removesuffix(")").replace("...", arguments)
