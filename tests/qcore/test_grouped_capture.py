"""The grouped form of a capture: each projection of every expert of a block one grouped_linear node, computing what
the capture with one Linear per expert computes, bit for bit, on batches routed otherwise than the example."""
import pytest
import torch

import qcore
from qcore.graph.capture import _export, experts_grouped
from qcore.graph.experts import fused_experts_modules, grouped_experts
from qcore.graph.grouped import find_grouped_ops
from tests.models import MOE_ARCHITECTURES, logits_of, tiny_moe

pytest.importorskip("transformers")

ARCHITECTURES = MOE_ARCHITECTURES


@pytest.mark.parametrize("architecture", ARCHITECTURES)
def test_a_grouped_capture_computes_what_the_per_expert_capture_does(architecture):
    model, data = tiny_moe(architecture, layers=2, experts=4, batch=4)
    implementation = model.config._experts_implementation
    with grouped_experts(model) as blocks:
        grouped = _export(model, (), data[0])
    assert set(blocks) == set(fused_experts_modules(model)) == {f"model.layers.{i}.mlp.experts" for i in range(2)}
    assert model.config._experts_implementation == implementation  # the model is left as it was
    nodes = [node for node in grouped.graph.nodes if node.target is torch.ops.qcore.grouped_linear.default]
    assert len(nodes) == 2 * 3  # gate, up and down a block, whatever the expert count
    assert [(op.block, op.name, op.experts) for op in find_grouped_ops(grouped)] == [
        (f"model.layers.{i}.mlp.experts", name, 4) for i in range(2) for name in ("gate_proj", "up_proj", "down_proj")]
    assert not [node for node in grouped.graph.nodes if node.target is torch.ops.aten.linear.default
                and ".experts." in str(node.meta.get("nn_module_stack"))]
    per_expert = qcore.capture(model, data[0])
    with torch.no_grad():
        eager = logits_of(model(**data[1]))
    for batch in data[1:]:  # routed otherwise than the example the graphs were traced on
        assert torch.equal(logits_of(grouped(**batch)), logits_of(per_expert(**batch)))
    torch.testing.assert_close(logits_of(grouped(**data[1])), eager, atol=2e-5, rtol=1e-4)


def test_a_grouped_capture_costs_the_same_nodes_whatever_the_expert_count():
    sizes = {}
    for experts in (4, 32):
        model, data = tiny_moe("qwen3_moe", experts=experts, batch=2)
        with grouped_experts(model):
            sizes[experts] = len(_export(model, (), data[0]).graph.nodes)
    assert sizes[4] == sizes[32]


def test_a_grouped_capture_reads_no_fused_parameter_and_names_its_blocks():
    model, data = tiny_moe("qwen3_moe", layers=2, experts=4)
    with experts_grouped():
        gm = qcore.capture(model, data[0])
    assert not [node.target for node in gm.graph.nodes
                if node.op == "get_attr" and not node.users and ".experts." in str(node.target)]
    assert gm.meta["qcore_experts"]["grouped"] and set(gm.meta["qcore_experts"]["blocks"]) == {
        "model.layers.0.mlp.experts", "model.layers.1.mlp.experts"}
    assert not [name for name, _ in model.named_parameters() if "grouped_" in name]  # the model as it was
    assert torch.equal(logits_of(gm(**data[1])), logits_of(qcore.capture(model, data[0])(**data[1])))
