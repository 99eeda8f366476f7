"""Finding details as JSON-like builtins (pytest_qreport.core.findings.to_builtins)."""
import math

import torch
from hypothesis import given
from hypothesis import strategies as st

from pytest_qreport.core.findings import Finding, to_builtins

_leaves = st.one_of(st.none(), st.booleans(), st.integers(), st.floats(allow_nan=False), st.text(max_size=3),
                    st.builds(torch.tensor, st.lists(st.floats(-1e3, 1e3), max_size=3)))
_values = st.recursive(_leaves, lambda inner: st.one_of(
    st.lists(inner, max_size=5), st.lists(inner, max_size=5).map(tuple),
    st.dictionaries(st.text(max_size=3), inner, max_size=4)), max_leaves=20)


def _converted_one_by_one(value):
    """What to_builtins gives, converting every element of a sequence on its own."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, dict):
        return {str(k): _converted_one_by_one(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_converted_one_by_one(v) for v in value]
    return _converted_one_by_one(value.tolist())


@given(_values)
def test_details_convert_as_each_element_alone_would_and_never_share_a_list(value):
    converted = to_builtins(value)
    assert converted == _converted_one_by_one(value)
    if isinstance(value, list):
        assert converted is not value  # a finding's details are its own copy


def test_an_experts_values_are_plain_numbers_in_a_finding():
    values = [0.5, 1, float("inf"), None, "expert 3"]
    finding = Finding("m", "sqnr", "model.layers.0.mlp.experts.down_proj", "sqnr_db", 1.0, 20.0, "fail",
                      details={"experts": values, "pairs": [(1, 2.0)], "tensor": torch.tensor([1.5, math.inf])})
    assert finding.details == {"experts": values, "pairs": [[1, 2.0]], "tensor": [1.5, math.inf]}
    assert finding.details["experts"] is not values
