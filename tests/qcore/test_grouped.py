"""A projection of every expert as one op: the values of one F.linear per expert, bit for bit, in a traced graph too."""
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.nn import functional as F  # noqa: N812

from qcore.graph.grouped import grouped_linear, rows_of_experts


def _per_expert(routed, counts, weight, bias=None):
    runs = routed.split(counts.tolist())
    return torch.cat([F.linear(run, weight[e], None if bias is None else bias[e]) for e, run in enumerate(runs)])


@settings(max_examples=40, deadline=None)
@given(counts=st.lists(st.integers(0, 70), min_size=1, max_size=9), features=st.integers(1, 80),
       out=st.integers(1, 96), dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]),
       layout=st.sampled_from(["fused", "transposed", "half"]), bias=st.booleans(), seed=st.integers(0, 2**16))
def test_grouped_linear_is_one_linear_per_expert(counts, features, out, dtype, layout, bias, seed):
    """Every count (none included), dtype and weight layout transformers' fused experts hold: the same bits."""
    generator = torch.Generator().manual_seed(seed)
    experts = len(counts)
    counts = torch.tensor(counts)
    routed = torch.randn(int(counts.sum()), features, generator=generator).to(dtype)
    if layout == "transposed":  # held [E, in, out], computed with its transpose (is_transposed)
        weight = torch.randn(experts, features, out, generator=generator).to(dtype).transpose(1, 2)
    elif layout == "half":  # the up half of a fused [E, 2 out, in] gate_up parameter
        weight = torch.randn(experts, 2 * out, features, generator=generator).to(dtype).narrow(1, out, out)
    else:
        weight = torch.randn(experts, out, features, generator=generator).to(dtype)
    biases = torch.randn(experts, out, generator=generator).to(dtype) if bias else None
    assert torch.equal(grouped_linear(routed, counts, weight, biases), _per_expert(routed, counts, weight, biases))


def test_grouped_linear_without_rows():
    """No routed token at all (a batch that routed none to this block's experts): an empty result of its width."""
    found = grouped_linear(torch.empty(0, 8), torch.zeros(4, dtype=torch.long), torch.randn(4, 16, 8))
    assert found.shape == (0, 16)


@pytest.mark.parametrize("routed,counts,weight,message", [
    ((5, 8), [2, 3], (3, 16, 8), "2 counts"),
    ((5, 8), [2, 3], (2, 16, 4), "routed rows of 8 features"),
    ((5, 8, 1), [2, 3], (2, 16, 8), "routed rows"),
])
def test_grouped_linear_names_what_does_not_fit(routed, counts, weight, message):
    with pytest.raises(ValueError, match=message):
        grouped_linear(torch.randn(routed), torch.tensor(counts), torch.randn(weight))


class _Projection(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(4, 12, 8), requires_grad=False)

    def forward(self, routed, counts):
        return grouped_linear(routed, counts, self.weight)


def test_grouped_linear_exports_as_one_node():
    """torch.export records the op as one node of routed rows of any count, and the graph computes the same."""
    model = _Projection()
    counts = torch.tensor([3, 0, 5, 2])
    routed = torch.randn(10, 8)
    rows = torch.export.Dim("rows")
    program = torch.export.export(model, (routed, counts), dynamic_shapes=({0: rows}, None))
    nodes = [node for node in program.graph.nodes if node.target is torch.ops.qcore.grouped_linear.default]
    assert len(nodes) == 1
    other = torch.tensor([1, 6, 0, 0])
    routed = torch.randn(7, 8)
    assert torch.equal(program.module()(routed, other), _per_expert(routed, other, model.weight))


def test_rows_of_experts_spreads_each_experts_value_over_its_run():
    values = torch.tensor([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]])
    counts = torch.tensor([2, 0, 1])
    assert torch.equal(rows_of_experts(values, counts, 3), torch.tensor([[1.0, 2.0], [1.0, 2.0], [5.0, 6.0]]))

