"""The plugin captures an MoE model's fused experts with each projection of every expert as one op (a grouped
capture) where its analysis measures that form, and its items are the items of the same model captured one layer per
expert: the same names, verdicts, values and messages for
every default check, the detectors' screens, the equalization variants, the fix trials and the float_layers
search on experts included, with the verdicts alone and with searches run to their end. (Within a finite fix budget
a search may stop elsewhere: a run resumed part-way counts the share of the graph's nodes it computes, and the two
graphs hold different nodes.)"""
import pytest

from pytest_qreport.checks import BUILTIN_CHECKS
from pytest_qreport.core import pipeline as pipelines
from qcore.graph.capture import experts_grouped
from qcore.graph.grouped import find_grouped_ops
from tests.helpers import analyze_with_checks
from tests.models import tiny_moe

pytest.importorskip("transformers")

DEFAULT_CHECKS = [check.name for check in BUILTIN_CHECKS if check.default_severity != "off"]


@pytest.mark.parametrize(("architecture", "fix_budget"), [("qwen3_moe", 1000.0), ("gpt_oss", 1000.0),
                                                          ("deepseek_v3", 0.0)])
def test_a_grouped_capture_gives_the_per_expert_captures_items(architecture, fix_budget):
    """Thresholds that make the dynamic-vs-static and the outlier items fail, so that their screens measure each
    expert's fix in the comparison pass and, with a fix budget, their trials the whole model with it (the outlier
    heuristic on every batch, as torch.ao's: these experts see a few tokens a batch)."""
    model, batches = tiny_moe(architecture, layers=2, experts=4, n=4)
    settings = dict(checks=DEFAULT_CHECKS, fix_budget=fix_budget, outlier_min_gain_db=0.0,
                    dynamic_static_min_gain_db=0.0,
                    check_options={"dynamic_static": {"tolerance": 0.9},
                                   "outlier": {"ratio_threshold": 1.5, "expert_min_batch_tokens": 0}})
    with experts_grouped(False):
        per_expert, analysis = analyze_with_checks(lambda: model, batches, **settings)
    assert not find_grouped_ops(analysis.float_gm)
    grouped, analysis = analyze_with_checks(lambda: model, batches, **settings)  # the plugin's default
    assert find_grouped_ops(analysis.float_gm), "the plugin captures fused experts one op a projection"
    assert analysis.expert_layers, "the grouped capture names its experts' layers"
    assert grouped.keys() == per_expert.keys()
    experts = [key for key in per_expert if ".experts." in key[1]]
    tried = "measured with the fix" if fix_budget else "in the comparison pass, with"
    for check in ("dynamic_static", "outlier"):
        assert any(per_expert[key].verdict == "fail" and tried in per_expert[key].message
                   for key in experts if key[0] == check), f"an expert projection's {check} fix was measured"
    gains = [per_expert[key].value for key in experts if key[0] == "equalization"]
    assert gains and all(gain == gain for gain in gains), "every expert projection's equalization was measured"
    for key, expected in per_expert.items():
        found = grouped[key]
        assert (found.verdict, found.message) == (expected.verdict, expected.message), key
        assert found.value == expected.value or (found.value != found.value and expected.value != expected.value), key


def test_the_plugin_captures_experts_one_linear_each_where_the_analysis_does_not_measure_the_grouped_form():
    """A format (its fix searches give experts of one projection different formats), per-tensor weights (the
    per-channel fix changes one expert's), and a layer override the grouped form refuses: one Linear per expert,
    with the items of the per-expert capture."""
    model, batches = tiny_moe("qwen3_moe", layers=1, experts=4, n=3)
    for settings in ({"quantizer": "W4A16"}, {"quantizer": "int8", "layer_overrides": {
            "model.layers.0.mlp.experts.1.down_proj": {"per_channel": False}}}):
        _, analysis = analyze_with_checks(lambda: model, batches, checks=["sqnr"], **settings)
        assert not find_grouped_ops(analysis.float_gm), settings
        assert "model.layers.0.mlp.experts.1.down_proj" in analysis.expert_layers


def test_the_plugin_captures_a_large_models_experts_one_linear_each(monkeypatch):
    """A large model (weights quantized where read): one Linear per expert, which at the 30B shape holds less memory
    than the grouped form for the same time (the performance page)."""
    monkeypatch.setattr(pipelines, "LARGE_MODEL_BYTES", 0)
    model, batches = tiny_moe("qwen3_moe", layers=1, experts=4, n=3)
    _, analysis = analyze_with_checks(lambda: model, batches, checks=["sqnr"])
    assert not find_grouped_ops(analysis.float_gm)
    assert "model.layers.0.mlp.experts.1.down_proj" in analysis.expert_layers


def test_a_large_moes_outlier_screen_reads_each_expert_weight_as_the_experts_own_shadow_quantized_it(monkeypatch):
    """A large model's weights are quantized where read. The outlier screen changes only an expert's activation
    observer, so its shadow of the expert reads the weight the expert's own shadow quantized: one pass over each
    expert weight a batch in the float graph, not one a shadow (an expert weight serves the few tokens routed to it,
    and a second pass a batch for each is a large share of a 30B-shaped MoE's analysis)."""
    import importlib

    from qcore.numeric import instrument
    from qcore.quantization.convert import fake_quantize_where_read

    compare = importlib.import_module("qcore.numeric.compare")  # the module: qcore.numeric's `compare` is a function

    monkeypatch.setattr(pipelines, "LARGE_MODEL_BYTES", 0)
    passes = []

    def merged_then_counted(graph):
        merged = instrument.merge_repeated_shadow_weights(graph)
        reads = [instrument._weight_read(graph.owning_module, node) for node in graph.nodes
                 if node.op == "call_function" and node.target is fake_quantize_where_read]
        weights = [read[0] for read in reads if read is not None]
        passes.append((merged, len(weights), len(set(weights))))
        return merged

    monkeypatch.setattr(compare, "merge_repeated_shadow_weights", merged_then_counted)
    model, batches = tiny_moe("qwen3_moe", layers=1, experts=4, n=3)
    found, analysis = analyze_with_checks(lambda: model, batches, checks=["sqnr", "outlier"], fix_budget=0.0,
                                          outlier_min_gain_db=0.0,
                                          check_options={"outlier": {"ratio_threshold": 1.5,
                                                                     "expert_min_batch_tokens": 0}})
    assert not find_grouped_ops(analysis.float_gm)
    screened = [layer for layer in analysis.measurement.screens["outlier"].changes if ".experts." in layer]
    assert screened and any(finding.verdict == "fail" for (check, item), finding in found.items()
                            if check == "outlier" and ".experts." in item)
    merged, reads, weights = passes[0]
    assert merged >= len(screened), "each screened expert's shadow read its own shadow's quantized weight"
    assert reads == weights, "no weight is quantized twice with the same qparams in one float-graph run"
