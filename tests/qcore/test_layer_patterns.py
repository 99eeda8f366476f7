"""LayerPatterns matches what matches_layer matches, in the patterns' order, and quantizers read it."""
from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from qcore.graph.ops import LayerPatterns, matches_layer

PARTS = st.sampled_from(["model", "layers", "0", "1", "mlp", "experts", "down_proj", "", "a", "b"])
GLOB_PARTS = st.one_of(PARTS, st.sampled_from(["*", "?", "[01]", "exp*", "*.down_proj"]))
NAMES = st.lists(PARTS, min_size=1, max_size=5).map(".".join)
PATTERNS = st.lists(GLOB_PARTS, min_size=1, max_size=4).map(".".join)


@settings(max_examples=400, deadline=None)
@given(st.lists(PATTERNS, max_size=8, unique=True), st.lists(NAMES, min_size=1, max_size=2))
def test_layer_patterns_match_as_matches_layer_does(patterns, names):
    assert LayerPatterns(patterns).matching(*names) == [p for p in patterns if matches_layer(p, *names)]


def test_quantizers_apply_overrides_in_their_order():
    import qcore

    quantizer = qcore.Int8StaticQuantizer(layer_overrides={"blocks": {"per_channel": True},
                                                           "blocks.0.*": {"per_channel": False},
                                                           "blocks.0.fc": {"is_dynamic": True}})
    settings_of = quantizer._settings("blocks.0.fc", "blocks.0.fc")
    assert settings_of["per_channel"] is False and settings_of["is_dynamic"] is True
    assert quantizer._settings("blocks.1.fc", "blocks.1.fc")["per_channel"] is True
    formats = qcore.FormatQuantizer("W8A8", layer_overrides={"blocks": {"skip": True},
                                                             "blocks.0.fc": {"format": "W4A16"}})
    assert formats.layer_preset("blocks.0.fc", "blocks.0.fc").name == "W4A16"
    assert formats.layer_preset("blocks.1.fc", "blocks.1.fc") is None
