"""Fused mixture-of-experts blocks (transformers 5): captured as one Linear per expert projection, each expert
quantized as the Linear it stands for, cross-checked against torch.ao on the tokens routed to it."""
import math
import warnings

import pytest
import torch
from torch.ao.quantization import observer as ao

import qcore
from qcore.analysis import measure_sqnr
from qcore.graph.experts import expert_layers, fused_experts_modules, moe_blocks, routers
from qcore.graph.ops import find_quantizable_ops
from qcore.numeric import compute_sqnr
from qcore.quantization.format_quantizer import FormatQuantizer
from tests.models import MOE_ARCHITECTURES, layer_calls, linearized_moe, logits_of, routed_tokens, tiny_moe

pytest.importorskip("transformers")

ARCHITECTURES = MOE_ARCHITECTURES


@pytest.mark.parametrize("architecture", ARCHITECTURES)
def test_fused_experts_are_captured_as_one_linear_per_expert_projection(architecture):
    model, data = tiny_moe(architecture, experts=4)
    with torch.no_grad():
        eager = model(**data[1]).logits  # transformers' default experts implementation (grouped_mm)
    implementation = model.config._experts_implementation
    gm = qcore.capture(model, data[0], name=architecture)
    # another batch routes its tokens otherwise: the graph computes the model's function, not batch 0's routing
    torch.testing.assert_close(logits_of(gm(**data[1])), eager, atol=2e-5, rtol=1e-4)
    experts = expert_layers(gm)
    assert sorted(experts) == sorted(f"model.layers.0.mlp.experts.{e}.{p}" for e in range(4)
                                     for p in ("gate_proj", "up_proj", "down_proj"))
    assert {entry.projection for entry in experts.values()} == {"model.layers.0.mlp.experts.gate_up_proj",
                                                                  "model.layers.0.mlp.experts.down_proj"}
    assert set(moe_blocks(gm)) == {"model.layers.0.mlp.experts"}
    layers = {op.layer for op in find_quantizable_ops(gm)}
    assert set(experts) <= layers
    # the model is left as it was given
    assert model.config._experts_implementation == implementation
    assert not [name for name, _ in model.model.layers[0].mlp.experts.named_children() if name.isdigit()]
    assert list(fused_experts_modules(model)) == ["model.layers.0.mlp.experts"]


@pytest.mark.parametrize("architecture", ARCHITECTURES)
def test_a_capture_from_one_template_per_block_is_the_graph_traced_expert_by_expert(architecture, monkeypatch):
    """The capture traces expert 0's projections once per block and copies them for every expert: the same ops in
    the same order, the same outputs to the bit, and the same numbers as a trace of every expert."""
    import contextlib

    import qcore.graph.capture as capture_module
    from qcore.graph.experts import expert_counts

    model, data = tiny_moe(architecture, experts=4, batch=4)
    templated = qcore.capture(model, data[0])
    assert sum(node.target is expert_counts for node in templated.graph.nodes) == 1  # the block's one host read
    # no parameter is fetched that no op reads (the fused ones, the reads the templates' copies replaced)
    assert not [node.target for node in templated.graph.nodes
                if node.op == "get_attr" and not node.users and ".experts." in str(node.target)]
    monkeypatch.setattr(capture_module, "traced_with_templates", contextlib.nullcontext)
    traced = qcore.capture(model, data[0])
    assert not any(node.target is expert_counts for node in traced.graph.nodes)

    def expert_linears(gm):
        return [(str(node.target), str(node.meta.get("qcore_fqn"))) for node in gm.graph.nodes
                if node.op == "call_function" and "linear" in str(node.target)
                and ".experts." in str(node.meta.get("qcore_fqn")) + "."]

    def layers(gm):
        return [(op.layer, op.kind) for op in find_quantizable_ops(gm)]

    assert layers(templated) == layers(traced) and expert_linears(templated) == expert_linears(traced)
    assert torch.equal(logits_of(templated(**data[1])), logits_of(traced(**data[1])))
    quantizer = qcore.Int8StaticQuantizer()
    a, b = measure_sqnr(templated, data, quantizer), measure_sqnr(traced, data, quantizer)
    assert {layer: value.sqnr_db for layer, value in a.layers.items()} == \
        {layer: value.sqnr_db for layer, value in b.layers.items()}


def test_a_template_trace_exports_expert_0_alone_and_the_graph_reads_every_experts_own_weights(monkeypatch):
    """torch.export lifts every parameter a module holds: the trace with templates sees expert 0's projections only,
    so that a block's trace costs the same at 128 experts as at 8, and the graph then reads each expert's own
    weights, views of the fused parameters, as a trace of every expert does; the model is left as it was."""
    model, data = tiny_moe("qwen3_moe", layers=2, experts=16, batch=4)
    before = [name for name, _ in model.named_modules()]
    exported = []
    original = torch.export.export

    def export(module, *args, **kwargs):  # which experts' own parameters the exported module holds
        exported.append(sorted({part for name, _ in module.named_parameters() if ".experts." in name
                                and (part := name.split(".experts.")[1].split(".")[0]).isdigit()}))
        return original(module, *args, **kwargs)

    monkeypatch.setattr(torch.export, "export", export)
    gm = qcore.capture(model, data[0])
    assert exported == [["0"]]  # one export: expert 0's own projections, no other expert's
    assert [name for name, _ in model.named_modules()] == before
    fused = model.model.layers[1].mlp.experts
    for expert in range(16):
        gate = gm.get_parameter(f"model.layers.1.mlp.experts.{expert}.gate_proj.weight")
        down = gm.get_parameter(f"model.layers.1.mlp.experts.{expert}.down_proj.weight")
        assert gate.untyped_storage().data_ptr() == fused.gate_up_proj.untyped_storage().data_ptr()
        assert torch.equal(gate, fused.gate_up_proj[expert][: gate.shape[0]])
        assert torch.equal(down, fused.down_proj[expert])
    assert {op.layer for op in find_quantizable_ops(gm)} >= {f"model.layers.1.mlp.experts.{expert}.up_proj"
                                                            for expert in range(16)}


def test_a_template_whose_shape_the_trace_fixed_to_every_routed_token_is_not_copied(monkeypatch):
    """An expert computation with a reshape to its input's row count is traced with that count fixed: copied for one
    expert's run of the tokens it would not fit, so the capture traces every expert instead, and runs."""
    import qcore.graph.experts as experts_module

    projection = experts_module._expert_projection

    def reshaping(module, expert, inputs):
        return projection(module, expert, inputs.reshape(inputs.shape[0], -1))

    model, data = tiny_moe("qwen3_moe", experts=4)
    monkeypatch.setattr(experts_module, "_expert_projection", reshaping)
    gm = qcore.capture(model, data[0])
    assert not any(node.target is experts_module.expert_counts for node in gm.graph.nodes)
    with torch.no_grad():
        torch.testing.assert_close(logits_of(gm(**data[1])), model(**data[1]).logits, atol=2e-5, rtol=1e-4)


def test_a_template_that_does_not_expand_falls_back_to_a_trace_of_every_expert(monkeypatch):
    import qcore.graph.capture as capture_module

    def refuse(gm, blocks):
        raise ValueError("not one expert's computation")

    model, data = tiny_moe("qwen3_moe", experts=4)
    monkeypatch.setattr(capture_module, "expand_expert_templates", refuse)
    gm = qcore.capture(model, data[0])
    with torch.no_grad():
        torch.testing.assert_close(logits_of(gm(**data[1])), model(**data[1]).logits, atol=2e-5, rtol=1e-4)
    assert len(expert_layers(gm)) == 12 and set(expert_layers(gm)) <= {op.layer for op in find_quantizable_ops(gm)}


@pytest.mark.parametrize("preset", ["int8", "W4A16"])
def test_experts_held_as_modules_are_measured_as_the_fused_experts_they_equal(preset):
    """llm-compressor's linearized form of a block (one MLP module per expert, a ModuleList) and transformers' fused
    form give every expert projection and the output the same numbers, named by the projection's common path."""
    model, data = tiny_moe("qwen3_moe", experts=4)
    linear = linearized_moe(model)
    block = "model.layers.0.mlp.experts"
    fused_gm, linear_gm = qcore.capture(model, data[0]), qcore.capture(linear, data[0])
    experts = expert_layers(linear_gm)
    assert sorted(experts) == sorted(expert_layers(fused_gm))
    assert {entry.projection for entry in experts.values()} == {f"{block}.{p}" for p in ("gate_proj", "up_proj",
                                                                                        "down_proj")}
    assert not moe_blocks(linear_gm)[block].fused and routers(linear_gm) == routers(fused_gm)
    quantizer = qcore.Int8StaticQuantizer() if preset == "int8" else FormatQuantizer(preset)
    fused, linearized = measure_sqnr(fused_gm, data, quantizer), measure_sqnr(linear_gm, data, quantizer)
    for layer in experts:
        assert linearized.layers[layer].sqnr_db == pytest.approx(fused.layers[layer].sqnr_db, abs=1e-6), layer
        assert linearized.layers[layer].weight_sqnr_db == pytest.approx(fused.layers[layer].weight_sqnr_db, abs=1e-9)
    assert linearized.worst_output().sqnr_db == pytest.approx(fused.worst_output().sqnr_db, abs=1e-6)


@pytest.mark.parametrize("implementation", ["grouped_mm", "batched_mm", "eager"])
def test_the_capture_computes_what_each_of_transformers_experts_implementations_does(implementation):
    model, data = tiny_moe("qwen3_moe", experts=4)
    model.set_experts_implementation(implementation)
    with torch.no_grad():
        eager = model(**data[1]).logits
    gm = qcore.capture(model, data[0])
    torch.testing.assert_close(logits_of(gm(**data[1])), eager, atol=2e-5, rtol=1e-4)
    assert len(expert_layers(gm)) == 12 and model.config._experts_implementation == implementation


def test_each_experts_activation_observer_sees_only_the_tokens_routed_to_it():
    model, data = tiny_moe("qwen3_moe", experts=4)
    routed = routed_tokens(model, data)
    prepared = qcore.prepare(qcore.capture(model, data[0]), qcore.Int8StaticQuantizer())
    for batch in data:
        prepared(**batch)
    ops = {op.layer: op for op in find_quantizable_ops(prepared)}
    for expert in range(4):
        reference = ao.MinMaxObserver(dtype=torch.qint8)
        for tokens in routed[expert]:
            reference(tokens)
        for projection in ("gate_proj", "up_proj"):
            op = ops[f"model.layers.0.mlp.experts.{expert}.{projection}"]
            observer = prepared.get_submodule(op.node.args[0].target)
            assert observer.min_val == reference.min_val and observer.max_val == reference.max_val
            scale, zero_point = observer.calculate_qparams()
            ref_scale, ref_zero_point = reference.calculate_qparams()
            assert scale.item() == ref_scale.item() and zero_point.item() == ref_zero_point.item()


def test_each_experts_weight_is_quantized_per_channel_as_its_own_linear():
    model, data = tiny_moe("gpt_oss", experts=4)  # transposed and interleaved: the hardest slices to get right
    measured = measure_sqnr(qcore.capture(model, data[0]), data)
    experts = model.model.layers[0].mlp.experts
    for expert in range(4):
        gate_up = experts.gate_up_proj[expert].detach().t()  # [2I, H], gate and up interleaved by row
        for name, weight in (("gate_proj", gate_up[0::2]), ("up_proj", gate_up[1::2]),
                             ("down_proj", experts.down_proj[expert].detach().t())):
            scale = weight.abs().amax(1) / 127
            zero = torch.zeros_like(scale, dtype=torch.int32)
            reference = torch.fake_quantize_per_channel_affine(weight, scale, zero, 0, -127, 127)
            layer = f"model.layers.0.mlp.experts.{expert}.{name}"
            assert measured.layers[layer].weight_sqnr_db == pytest.approx(float(compute_sqnr(weight, reference)),
                                                                         abs=1e-3)


@pytest.mark.parametrize(("architecture", "preset"), [
    *(("qwen3_moe", name) for name in ("int8", "W8A8", "W8A16", "W4A16", "W4A16_ASYM", "FP8", "FP8_DYNAMIC",
                                       "FP8_BLOCK", "MXFP8", "MXFP4", "NVFP4", "NVFP4A16")),
    ("mixtral", "NVFP4"), ("gpt_oss", "W4A16"), ("olmoe", "FP8"), ("qwen2_moe", "MXFP4")])
def test_every_expert_projection_is_measured_under_the_deployed_formats(architecture, preset):
    model, data = tiny_moe(architecture, experts=4)
    quantizer = qcore.Int8StaticQuantizer() if preset == "int8" else FormatQuantizer(preset)
    measured = measure_sqnr(qcore.capture(model, data[0]), data, quantizer)
    experts = [f"model.layers.0.mlp.experts.{e}.{p}" for e in range(4) for p in ("gate_proj", "up_proj", "down_proj")]
    for layer in experts:
        entry = measured.layers[layer]
        assert 10 < entry.weight_sqnr_db < 60 and 5 < entry.sqnr_db < 60, (layer, entry)
    assert measured.outputs


def test_an_expert_no_token_reaches_leaves_every_pass_running():
    model, data = tiny_moe("qwen3_moe", experts=5)
    router = model.model.layers[0].mlp.gate.weight
    with torch.no_grad():  # logits (a, -a, 0, b, -b): |a| and |b| win the top-2, expert 2 never does
        router[1], router[2], router[4] = -router[0], 0.0, -router[3]
    gm = qcore.capture(model, data[0])
    for quantizer in (qcore.Int8StaticQuantizer(), FormatQuantizer("NVFP4")):
        measured = measure_sqnr(gm, data, quantizer)
        assert measured.worst_output().sqnr_db > 5
        starved = measured.layers["model.layers.0.mlp.experts.2.down_proj"]
        # nothing compared is no measurement (not a perfect one); its weight is measured as any other
        assert starved.batches == 0 and math.isnan(starved.sqnr_db) and starved.weight_sqnr_db > 15
        assert measured.layers["model.layers.0.mlp.experts.1.down_proj"].batches == len(data)


def test_an_expert_no_token_reaches_gets_no_equalization_variant_and_the_others_do():
    from qcore.analysis import AnalysisPlan, ModelAnalysis
    from qcore.report import InputWeightEqualizationDetector

    model, data = tiny_moe("qwen3_moe", experts=5)
    router = model.model.layers[0].mlp.gate.weight
    with torch.no_grad():  # expert 2 never wins the top-2, as above
        router[1], router[2], router[4] = -router[0], 0.0, -router[3]
    plan = AnalysisPlan(measurements=frozenset({"sqnr", "detectors", "equalization"}),
                        detectors={"input_weight_equalization": InputWeightEqualizationDetector(0.5)})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        analysis = ModelAnalysis(qcore.capture(model, data[0]), qcore.Int8StaticQuantizer(), data, plan=plan)
        variants, unmeasured = analysis.equalization_variants, analysis.unmeasured_variants
    starved = "model.layers.0.mlp.experts.2.down_proj"
    assert starved not in variants and "no calibration token reached it" in unmeasured[starved]
    assert "model.layers.0.mlp.experts.1.down_proj" in variants
    assert math.isnan(analysis.sqnr.layers[starved].sqnr_db) and analysis.sqnr.worst_output().sqnr_db > 5
    # one warning a conversion, naming the layers whose inputs calibration never reached
    unreached = [str(w.message) for w in caught if "no calibration batch reached" in str(w.message)]
    assert unreached and all(starved in message and "qcore_observer" not in message for message in unreached)


def test_equalizing_experts_that_a_batch_or_every_batch_misses_computes_the_same_function():
    from qcore.analysis import ModelAnalysis
    from qcore.graph.inputs import call_model
    from qcore.rewrites.equalize import equalize

    model, data = tiny_moe("qwen3_moe", experts=16)  # 64 routed tokens a batch: some experts miss some batches
    router = model.model.layers[0].mlp.gate.weight
    with torch.no_grad():  # logits a, -a, 0, b, -b, ...: |a| and |b| beat 0, so expert 2 is never in the top-2
        router[1], router[2], router[4] = -router[0], 0.0, -router[3]
    gm = qcore.capture(model, data[0])
    tokens = routed_tokens(model, data)
    assert not any(len(chunk) for chunk in tokens[2])
    assert any(not len(chunk) for expert, chunks in tokens.items() if expert != 2 for chunk in chunks)
    layers = ModelAnalysis(gm, qcore.Int8StaticQuantizer(), data).equalizable_layers
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        equalized = equalize(gm, layers, data)
    left = [str(w.message) for w in caught if "left unequalized" in str(w.message)]
    assert len(left) == 1 and "model.layers.0.mlp.experts.2.down_proj" in left[0]
    scales = equalized.meta["qcore_equalization_scales"]
    assert "model.layers.0.mlp.experts.2.down_proj" not in scales and "model.layers.0.mlp.experts.1.down_proj" in scales
    for batch in data:
        expected, found = call_model(gm, batch), call_model(equalized, batch)
        assert torch.allclose(found.logits, expected.logits, atol=1e-4)


def test_equalizing_experts_by_glob_rewrites_the_layers_their_names_would():
    from qcore.graph.inputs import call_model
    from qcore.rewrites.equalize import EqualizationError, equalize

    model, data = tiny_moe("qwen3_moe", layers=2, experts=8)
    gm = qcore.capture(model, data[0])
    named = [f"model.layers.{b}.mlp.experts.{e}.down_proj" for b in range(2) for e in range(8)]
    named += ["model.layers.1.mlp.experts.3.up_proj"]
    by_name = equalize(gm, named, data)
    by_glob = equalize(gm, ["model.layers.*.mlp.experts.*.down_proj", "model.layers.1.mlp.experts.3.up_proj"], data)
    scales = by_glob.meta["qcore_equalization_scales"]
    assert scales == by_name.meta["qcore_equalization_scales"] and sorted(scales) == sorted(named)
    for batch in data:
        assert torch.equal(call_model(by_glob, batch).logits, call_model(by_name, batch).logits)
    block = equalize(gm, ["model.layers.1.mlp.experts"], data)  # a module's name reaches the layers it holds
    assert sorted(block.meta["qcore_equalization_scales"]) == sorted(
        f"model.layers.1.mlp.experts.{e}.{p}" for e in range(8) for p in ("gate_proj", "up_proj", "down_proj"))
    with pytest.raises(EqualizationError, match=r"model\.layers\.\*\.mlp\.experts\.\*\.down"):
        equalize(gm, ["model.layers.*.mlp.experts.*.down"], data)


def test_a_blockwise_analysis_cuts_at_the_decoder_layers_and_measures_what_the_whole_model_does():
    from qcore.analysis import AnalysisPlan, ModelAnalysis
    from qcore.measure.blockwise import block_stack
    from qcore.report import ExpertCoverageDetector

    model, data = tiny_moe("qwen3_moe", layers=2, experts=4)
    gm = qcore.capture(model, data[0])
    assert block_stack(gm) == "model.layers"  # not a block's experts, numbered as they are
    plan = AnalysisPlan(measurements=frozenset({"sqnr", "detectors"}),
                        detectors={"expert_coverage": ExpertCoverageDetector()})
    whole = ModelAnalysis(gm, FormatQuantizer("W4A16"), data, plan=plan)
    blocks = ModelAnalysis(gm, FormatQuantizer("W4A16"), data, plan=plan, blockwise=True)
    for layer, entry in whole.sqnr.layers.items():
        assert blocks.sqnr.layers[layer].sqnr_db == pytest.approx(entry.sqnr_db, abs=1e-6), layer
    assert blocks.routing_agreement == whole.routing_agreement
    assert set(whole.routing_agreement) == {"model.layers.0.mlp.experts", "model.layers.1.mlp.experts"}
    assert blocks.measurement.detector_reports == whole.measurement.detector_reports
    tokens = whole.measurement.detector_reports["expert_coverage"]["model.layers.1.mlp.experts"]["tokens"]
    assert sum(tokens) == 2 * 2 * 16 * len(data)  # top-2 of every token of every batch


def test_a_checkpoints_fused_experts_are_compared_expert_by_expert():
    import copy

    from qcore.artifact.experts import checkpoint_experts
    from qcore.artifact.layers import ArtifactMismatchError, artifact_layers
    from qcore.formats.presets import preset

    reference = tiny_moe("qwen3_moe", experts=4)[0]
    quantized = copy.deepcopy(reference)
    experts = quantized.model.layers[0].mlp.experts
    with torch.no_grad():  # dequantized at load, as transformers 5 loads a compressed-tensors MoE checkpoint
        for fused in (experts.gate_up_proj, experts.down_proj):
            fused.copy_(torch.stack([preset("W4A16").weight.fake_quantize(w, weight=True) for w in fused]))
        experts.down_proj[1, 0, 0] = float("nan")
        experts.gate_up_proj[2] = 0.0
    found = checkpoint_experts(reference, quantized)["model.layers.0.mlp.experts"]
    assert found.experts == 4 and found.zeros == (2,) and found.non_finite == (1,)
    original = reference.model.layers[0].mlp.experts
    for expert in (0, 3):
        assert found.weight_sqnr_db["down_proj"][expert] == pytest.approx(
            float(compute_sqnr(original.down_proj[expert].detach(), experts.down_proj[expert].detach())), abs=1e-4)
    # the experts are the only change: the error says so, and how to measure them
    with pytest.raises(ArtifactMismatchError, match="only changed modules are the fused experts of 1 MoE block"):
        artifact_layers(reference, quantized)


def test_routers_are_found_where_the_choice_is_the_top_k_of_one_layers_output():
    from qcore.graph.experts import routers

    for architecture, router in (("qwen3_moe", "model.layers.0.mlp.gate"), ("mixtral", "model.layers.0.mlp.gate"),
                                 ("gpt_oss", "model.layers.0.mlp.router"), ("deepseek_v3", None)):
        model, data = tiny_moe(architecture, experts=4)
        found = routers(qcore.capture(model, data[0], name=architecture))
        if router is None:  # chosen by groups, with a score correction bias: not the top-k of the router's output
            assert found == {}, architecture
        else:
            assert [(r.layer, r.top_k, r.experts) for r in found.values()] == [(router, 2, 4)], architecture


def test_a_checkpoint_holding_its_experts_as_modules_is_measured_expert_by_expert_on_the_references_tokens():
    """llm-compressor's linearized form quantized by a tool (torchao here), expert 3's down_proj written as zeros (as
    GPTQ writes an expert no calibration token reached): each expert layer's SQNR is its output on the tokens the
    reference routes to it, against the reference expert's (forward hooks), and the zeros are named."""
    import copy

    from torchao.quantization import Int8WeightOnlyConfig

    from qcore.artifact import ArtifactAnalysis
    from tests.helpers import torchao_artifact

    model, data = tiny_moe("qwen3_moe", experts=4)
    reference = linearized_moe(model)
    damaged = copy.deepcopy(reference)
    with torch.no_grad():
        damaged.model.layers[0].mlp.experts[3].down_proj.weight.zero_()
    quantized = torchao_artifact(damaged, Int8WeightOnlyConfig())
    block = "model.layers.0.mlp.experts"
    analysis = ArtifactAnalysis(reference, quantized, data)
    assert sorted(analysis.expert_layers) == sorted(f"{block}.{e}.{p}" for e in range(4)
                                                    for p in ("gate_proj", "up_proj", "down_proj"))
    calls = layer_calls(reference, [f"{block}.{e}.down_proj" for e in range(4)], data)
    for expert in range(4):
        inputs, outputs = calls[f"{block}.{expert}.down_proj"]
        layer = quantized.get_submodule(f"{block}.{expert}.down_proj")
        with torch.no_grad():
            ours = torch.cat([layer(x) for x in inputs])
        expected = float(compute_sqnr(torch.cat(outputs), ours))
        measured = analysis.sqnr.layers[f"{block}.{expert}.down_proj"].sqnr_db
        assert measured == pytest.approx(expected, abs=0.01), (expert, measured)
        assert (measured == pytest.approx(0.0, abs=1e-6)) == (expert == 3)  # zeros: all signal is error
    found = analysis.checkpoint_experts[block]
    assert found.experts == 4 and found.zeros == (3,) and not found.non_finite
    downs = found.weight_sqnr_db["down_proj"]
    assert downs[3] == pytest.approx(0.0) and min(downs[:3]) > 30


def test_a_checkpoint_holding_its_experts_as_modules_pairs_with_a_fused_reference_and_leaves_it_as_it_was():
    """The user's transformers 5 model (fused experts) as the reference of llm-compressor's linearized form quantized
    by a tool: every expert layer pairs with a view of the fused weights, with the numbers of the linearized
    reference."""
    from torchao.quantization import Int8WeightOnlyConfig

    from qcore.artifact import ArtifactAnalysis
    from tests.helpers import torchao_artifact

    model, data = tiny_moe("qwen3_moe", experts=4)
    quantized = torchao_artifact(linearized_moe(model), Int8WeightOnlyConfig())
    fused = ArtifactAnalysis(model, quantized, data)
    linear = ArtifactAnalysis(linearized_moe(model), quantized, data)
    assert sorted(fused.expert_layers) == sorted(linear.expert_layers) and len(fused.expert_layers) == 12
    for name, entry in linear.sqnr.layers.items():
        assert fused.sqnr.layers[name].sqnr_db == pytest.approx(entry.sqnr_db, abs=1e-4), name
        assert fused.sqnr.layers[name].weight_sqnr_db == pytest.approx(entry.weight_sqnr_db, abs=1e-6), name
    assert fused.checkpoint_experts.keys() == linear.checkpoint_experts.keys()
    # the reference the user gave is untouched: no expert children, its own forward
    experts = model.model.layers[0].mlp.experts
    assert not [name for name, _ in experts.named_children() if name.isdigit()] and "forward" not in vars(experts)


def test_a_fix_of_every_expert_of_a_projection_is_one_pattern_in_each_tool_that_takes_patterns():
    """llm-compressor's `re:` and GPTQModel's dynamic regex match exactly the experts the glob covers (as each tool
    matches, re.match on module names); ModelOpt's wildcard every quantizer of theirs; the tools without patterns list
    each name."""
    import ast
    import fnmatch
    import re

    from qcore.artifact import tool_recipes
    from qcore.graph.experts import compact_expert_layers, held_expert_layers

    model = linearized_moe(tiny_moe("qwen3_moe", experts=4)[0])
    block = "model.layers.0.mlp.experts"
    names = [f"{block}.{e}.down_proj" for e in range(4)] + ["model.layers.0.self_attn.o_proj"]
    patterns = compact_expert_layers(names, held_expert_layers(model))
    assert patterns == [f"{block}.*.down_proj", "model.layers.0.self_attn.o_proj"]
    recipes = tool_recipes(names, ["lm_head"], None, patterns)
    modules = [name for name, _ in model.named_modules() if name]
    ignore = ast.literal_eval("[" + recipes["llm-compressor"].split("[..., ", 1)[1])  # as pasted
    expressions = [entry[3:] for entry in ignore if entry.startswith("re:")]
    assert [m for m in modules if any(re.match(expression, m) for expression in expressions)] == names[:4]
    dynamic = next(iter(ast.literal_eval(recipes["gptqmodel"].split("dynamic=", 1)[1][:-1])))
    assert [m for m in modules if re.match(dynamic.removeprefix("-:"), m)] == sorted(names, key=modules.index)
    wildcards = re.findall(r"'quantizer_name': '([^']+)'", recipes["modelopt"])
    quantizers = [f"{m}.weight_quantizer" for m in modules]
    assert {q.rsplit(".", 1)[0] for q in quantizers if any(fnmatch.fnmatch(q, w) for w in wildcards)} == set(names)
    assert recipes["float_layers"] == f"float_layers={patterns!r}"
    assert all(repr(name) in recipes["bitsandbytes"] for name in names)  # no patterns there: every name


@pytest.mark.parametrize("form", ["fused", "linearized"])
def test_a_layer_glob_naming_an_expert_projections_item_names_its_experts(form):
    """An MoE projection's items are named by its parameter's path (`mlp.experts.down_proj`; a fused model's gate and
    up halves by `mlp.experts.gate_up_proj`): the same name in a quantizer's layer_overrides, a format's overrides and
    equalize names that projection's expert layers, as the glob over its experts does."""
    from qcore.analysis import quantized_layers
    from qcore.graph.inputs import call_model
    from qcore.rewrites.equalize import equalize

    model, data = tiny_moe("qwen3_moe", layers=2, experts=4)
    gm = qcore.capture(model if form == "fused" else linearized_moe(model), data[0])
    block = "model.layers.1.mlp.experts"
    first = f"{block}.gate_up_proj" if form == "fused" else f"{block}.gate_proj"
    halves = ("gate_proj", "up_proj") if form == "fused" else ("gate_proj",)
    globs = {f"{block}.down_proj": [f"{block}.*.down_proj"], first: [f"{block}.*.{half}" for half in halves]}
    ops = find_quantizable_ops(gm)
    assert {op.layer: op.item for op in ops if op.item} == {
        layer: entry.projection for layer, entry in expert_layers(gm).items()}
    assert not [op for op in ops if "experts" not in op.layer and op.item]
    for item, expert_globs in globs.items():
        members = sorted(f"{block}.{e}.{half}" for e in range(4)
                         for half in (("down_proj",) if item.endswith("down_proj") else halves))
        skipped = quantized_layers(gm, qcore.Int8StaticQuantizer(layer_overrides={item: {"skip": True}}))
        assert skipped == quantized_layers(gm, qcore.Int8StaticQuantizer(
            layer_overrides={glob: {"skip": True} for glob in expert_globs}))
        assert not set(members) & {layer.layer for layer in skipped}
        fp8 = quantized_layers(gm, FormatQuantizer("W4A16", layer_overrides={item: {"format": "FP8"}}))
        assert fp8 == quantized_layers(gm, FormatQuantizer(
            "W4A16", layer_overrides={glob: {"format": "FP8"} for glob in expert_globs}))
        assert sorted(layer.layer for layer in fp8 if layer.format == "FP8") == members
    by_item = equalize(gm, [f"{block}.down_proj"], data)
    by_glob = equalize(gm, [f"{block}.*.down_proj"], data)
    assert sorted(by_item.meta["qcore_equalization_scales"]) == sorted(f"{block}.{e}.down_proj" for e in range(4))
    assert by_item.meta["qcore_equalization_scales"] == by_glob.meta["qcore_equalization_scales"]
    for batch in data:
        assert torch.equal(call_model(by_item, batch).logits, call_model(by_glob, batch).logits)
