"""The plugin's items of an MoE model captured with each projection of every expert as one op (a grouped capture)
are the items of the same model captured one layer per expert: the same names, verdicts, values and messages,
the detectors' screens and the fix trials on experts included. Left out, as a grouped capture does not measure them
yet: equalization (its variants and rewrites) and the float_layers search of a failing model_sqnr (its switchable
graph switches no expert), measured here only where model_sqnr passes or with the verdicts alone."""
import pytest

from qcore.graph.capture import experts_grouped
from tests.helpers import analyze_with_checks
from tests.models import tiny_moe

pytest.importorskip("transformers")

CHECKS = ["sqnr", "weight_sqnr", "model_sqnr", "per_channel", "dynamic_static", "outlier", "expert_coverage",
          "routing_agreement"]


@pytest.mark.parametrize(("architecture", "fix_budget"), [("qwen3_moe", 100.0), ("gpt_oss", 0.0)])
def test_a_grouped_capture_gives_the_per_expert_captures_items(architecture, fix_budget):
    """Thresholds that make the dynamic-vs-static and the outlier items fail, so that their screens measure each
    expert's fix in the comparison pass and, with a fix budget, their trials the whole model with it."""
    model, batches = tiny_moe(architecture, layers=2, experts=4, n=4)
    settings = dict(checks=CHECKS, fix_budget=fix_budget, outlier_min_gain_db=0.0, dynamic_static_min_gain_db=0.0,
                    check_options={"dynamic_static": {"tolerance": 0.9}, "outlier": {"ratio_threshold": 1.5}})
    per_expert, _ = analyze_with_checks(lambda: model, batches, **settings)
    with experts_grouped():
        grouped, analysis = analyze_with_checks(lambda: model, batches, **settings)
    assert analysis.expert_layers, "the grouped capture names its experts' layers"
    assert grouped.keys() == per_expert.keys()
    experts = [key for key in per_expert if ".experts." in key[1] and key[0] in ("dynamic_static", "outlier")]
    tried = "measured with the fix" if fix_budget else "in the comparison pass, with"
    assert any(per_expert[key].verdict == "fail" and tried in per_expert[key].message
               for key in experts), "an expert projection's fix was screened (and tried)"
    for key, expected in per_expert.items():
        found = grouped[key]
        assert (found.verdict, found.message) == (expected.verdict, expected.message), key
        assert found.value == expected.value or (found.value != found.value and expected.value != expected.value), key
