"""The numeric suite: metrics equal torch.ao's, the reference API's structure, and the streaming compare."""
import math

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st
from torch.ao.ns.fx import utils as ao_utils

import qcore
from qcore import numeric as ns
from qcore.graph.ops import find_quantizable_ops
from qcore.numeric.matching import layer_value
from tests.models import SmallCNN, SmallMLP, batches


@pytest.fixture(scope="module", params=["export", "fx"])
def quantized_mlp(request):
    model = SmallMLP().eval()
    data = batches((16, 32), n=5)
    float_gm, quant_gm = qcore.quantize(qcore.capture(model, data[0], method=request.param), data[0], data)
    return float_gm, quant_gm, data


@pytest.mark.parametrize("ours,ref", [
    (ns.compute_sqnr, ao_utils.compute_sqnr),
    (ns.compute_normalized_l2_error, ao_utils.compute_normalized_l2_error),
    (ns.compute_cosine_similarity, ao_utils.compute_cosine_similarity),
])
def test_metrics_equal_torch_ao(ours, ref):
    for seed in range(5):
        g = torch.Generator().manual_seed(seed)
        x = torch.randn(7, 9, generator=g)
        y = x + 0.05 * torch.randn(7, 9, generator=g)
        assert abs(float(ours(x, y)) - float(ref(x, y))) <= 1e-6
    pair = ([x, x], [y, y])
    assert [float(v) for v in ours(*pair)] == pytest.approx([float(v) for v in ref(*pair)], abs=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_large_tensors_sqnr_is_computed_a_few_rows_at_a_time(monkeypatch, dtype):
    """An LM head's weight SQNR without a float copy of its difference: the same value as torch.ao's formula."""
    from qcore.numeric import metrics

    g = torch.Generator().manual_seed(0)
    weight = torch.randn(37, 11, generator=g).to(dtype)
    quantized = (weight.float() + torch.randn(37, 11, generator=g) * 0.01).to(dtype)
    monkeypatch.setattr(metrics, "_ROWS_ELEMENTS", 40)  # 3 rows at a time
    expected = float(ao_utils.compute_sqnr(weight.float(), quantized.float()))
    assert metrics.large_tensor_sqnr(weight, quantized) == pytest.approx(expected, rel=1e-5)
    assert metrics.large_tensor_sqnr(weight, weight) == math.inf


def test_sqnr_of_identical_tensors_is_inf():
    x = torch.randn(10)
    assert math.isinf(float(ns.compute_sqnr(x, x)))


def test_extract_weights_structure_and_values(quantized_mlp):
    float_gm, quant_gm, _ = quantized_mlp
    results = ns.extract_weights("fp32", float_gm, "int8", quant_gm)
    assert list(results) == ["fc1", "fc2", "fc3"]
    entry = results["fc1"]["weight"]["int8"][0]
    assert {"type", "values", "ref_node_name", "prev_node_name", "ref_node_target_type", "prev_node_target_type",
            "index_within_arg", "index_of_arg", "fqn"} <= set(entry)
    assert entry["type"] == "weight" and entry["fqn"] == "fc1"
    ns.extend_logger_results_with_comparison(results, "fp32", "int8", ns.compute_sqnr, "sqnr")
    assert 40 < float(results["fc1"]["weight"]["int8"][0]["sqnr"][0]) < 60


def test_add_loggers_matches_streaming_compare(quantized_mlp):
    float_gm, quant_gm, data = quantized_mlp
    logged_a, logged_b = ns.add_loggers("fp32", float_gm, "int8", quant_gm, ns.OutputLogger)
    for batch in data:
        logged_a(batch)
        logged_b(batch)
    results = ns.extract_logger_info(logged_a, logged_b, ns.OutputLogger, "int8")
    assert list(results) == ["fc1", "fc2", "fc3"]
    assert len(results["fc2"]["node_output"]["int8"][0]["values"]) == len(data)
    streamed = {r["layer"]: r for r in ns.compare(float_gm, quant_gm, data)}
    for layer, per_type in results.items():
        a = torch.cat(per_type["node_output"]["fp32"][0]["values"])
        b = torch.cat(per_type["node_output"]["int8"][0]["values"])
        assert streamed[layer]["sqnr_db"] == pytest.approx(float(ns.compute_sqnr(a, b)), abs=1e-3)
        assert streamed[layer]["cosine"] == pytest.approx(float(ns.compute_cosine_similarity(a, b)), abs=1e-5)
        assert streamed[layer]["normalized_l2"] == pytest.approx(float(ns.compute_normalized_l2_error(a, b)),
                                                                 rel=1e-4)
        assert streamed[layer]["batches"] == len(data)


def test_shadow_loggers_match_shadow_compare(quantized_mlp):
    float_gm, quant_gm, data = quantized_mlp
    shadow = ns.add_shadow_loggers("fp32", float_gm, "int8", quant_gm, ns.OutputLogger)
    for batch in data:
        shadow(batch)
    results = ns.extract_shadow_logger_info(shadow, ns.OutputLogger, "int8")
    ns.extend_logger_results_with_comparison(results, "fp32", "int8", ns.compute_sqnr, "sqnr")
    streamed = {r["layer"]: r for r in ns.compare(float_gm, quant_gm, data, propagate=False)}
    for layer, per_type in results.items():
        a = torch.cat(per_type["node_output"]["fp32"][0]["values"])
        b = torch.cat(per_type["node_output"]["int8"][0]["values"])
        assert streamed[layer]["sqnr_db"] == pytest.approx(float(ns.compute_sqnr(a, b)), abs=1e-3)
    # the first layer sees the same input either way
    assert streamed["fc1"]["sqnr_db"] == pytest.approx({r["layer"]: r for r in ns.compare(
        float_gm, quant_gm, data)}["fc1"]["sqnr_db"], abs=1e-6)


def test_shadow_isolates_a_bad_layer():
    """A noisy layer upstream drags later propagated SQNRs down; the shadow SQNR of later layers stays high."""
    model = SmallCNN().eval()
    data = batches((4, 3, 16, 16), n=4)
    float_gm, quant_gm = qcore.quantize(model, data[0], data)
    with torch.no_grad():
        weight = quant_gm.qcore_fq_conv1_weight
        weight += 0.3 * weight.abs().max() * torch.randn_like(weight)
    propagated = {r["layer"]: r["sqnr_db"] for r in ns.compare(float_gm, quant_gm, data)}
    shadow = {r["layer"]: r["sqnr_db"] for r in ns.compare(float_gm, quant_gm, data, propagate=False)}
    assert propagated["conv1"] < 15 and shadow["conv1"] < 15
    assert shadow["conv2"] > propagated["conv2"] + 10


def test_streaming_compare_is_flat_in_batches_and_never_copies_to_host(quantized_mlp, forbid_host_sync,
                                                                       monkeypatch):
    float_gm, quant_gm, data = quantized_mlp
    from qcore.numeric import loggers

    states = []
    real_result = loggers.StreamingComparator.result

    def checked_result(self):
        states.append(tuple(b.numel() for b in self.buffers()))
        monkeypatch.undo()  # allow the single final host copy
        return real_result(self)

    monkeypatch.setattr(loggers.StreamingComparator, "result", checked_result)
    many = data * 20
    ns.compare(float_gm, quant_gm, many)
    assert states and all(s == (4,) for s in states)


@pytest.mark.parametrize("activation", ["SiLU", "Hardswish", "ReLU6", "Hardsigmoid"])
@pytest.mark.parametrize("method", ["export", "fx"])
def test_an_in_place_activation_after_a_layer_does_not_rewrite_its_reference(activation, method):
    from qcore.analysis import measure_sqnr

    def model(inplace):
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(8, 16), getattr(torch.nn, activation)(inplace=inplace),
                                   torch.nn.Linear(16, 4)).eval()

    data = batches((32, 8), n=3)
    results = [measure_sqnr(qcore.capture(model(inplace), data[0], method=method), data) for inplace in (True, False)]
    in_place, out_of_place = ({f"{k}/{kind}": getattr(v, kind) for k, v in r.layers.items()
                                for kind in ("sqnr_db", "shadow_sqnr_db")} for r in results)
    assert in_place == pytest.approx(out_of_place, abs=1e-6)
    assert min(in_place.values()) > 20  # not the ~-2 dB of a reference overwritten in place


def test_a_layer_value_is_copied_for_the_comparison_only_where_something_may_change_it_later():
    from qcore.graph.ops import may_change_after

    def model(inplace):
        return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(inplace=inplace), torch.nn.Linear(16, 4),
                                   torch.nn.Flatten())

    def verdicts(gm):
        return [may_change_after(layer_value(op)) for op in find_quantizable_ops(gm)]

    x = torch.randn(2, 8)
    assert verdicts(qcore.capture(model(False).eval(), x, method="export")) == [False, False]
    # torch.export keeps the in-place ReLU (aten.relu_), fused into the first layer, whose value it writes
    assert verdicts(qcore.capture(model(True).eval(), x, method="export")) == [True, False]
    assert verdicts(qcore.capture(model(False).eval(), x, method="fx")) == [True, True]  # module calls


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float64])
def test_non_float32_pairs_are_compared_a_bounded_number_of_elements_at_a_time(monkeypatch, dtype):
    """A bf16 LM's logits are compared in float64 a million elements at a time: the same sums as all at once."""
    from qcore.numeric import loggers

    g = torch.Generator().manual_seed(1)
    reference = torch.randn(5, 7, 13, generator=g).to(dtype)
    actual = (reference.double() + 0.01 * torch.randn(5, 7, 13, generator=g, dtype=torch.float64)).to(dtype)
    whole = ns.StreamingComparator()
    whole.update(reference, actual)
    monkeypatch.setattr(loggers, "_COMPARED_ELEMENTS", 64)  # 8 parts
    parts = ns.StreamingComparator()
    parts.update(reference, actual)
    torch.testing.assert_close(parts.sums, whole.sums, rtol=1e-12, atol=0)
    ref, act = reference.double().reshape(-1), actual.double().reshape(-1)
    expected = torch.stack([ref @ ref, act @ act, ref @ act, (ref - act) @ (ref - act)])
    torch.testing.assert_close(parts.sums, expected, rtol=1e-12, atol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("copy", [True, False])
def test_a_stashed_layer_value_keeps_its_dtype(dtype, copy):
    """A bf16 model's float layer values wait for the quantized pass in bf16, not as float64 copies four times the
    size (168 MB on the 0.5B Llama); a copy is overwritten by the next batch."""
    from qcore.numeric.loggers import ActivationStash

    stash = ActivationStash(copy=copy)
    value = torch.randn(4, 6).to(dtype)
    held = stash(value)
    assert held.dtype == dtype and torch.equal(held, value.reshape(-1))
    assert (held.data_ptr() == value.data_ptr()) is not copy
    value.mul_(2)  # an in-place op after the layer: only the copy keeps the layer's value
    assert torch.equal(stash.value, (value / 2 if copy else value).reshape(-1))


def _run_graph_pass(monkeypatch, name: str, run: bool, counts: list[int]) -> None:
    """Let compare_propagated_and_shadow run its graph pass `name` (of qcore.numeric.instrument), or not, and append
    what each call returns (0 when not run) to `counts`."""
    from qcore.numeric import instrument

    def counted(graph):
        counts.append(getattr(instrument, name)(graph) if run else 0)
        return counts[-1]

    monkeypatch.setattr(__import__("sys").modules["qcore.numeric.compare"], name, counted)


class _ThreeProjections(torch.nn.Module):
    """Query, key and value projections of one input, as an attention block has them."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = torch.nn.LayerNorm(16)
        self.query, self.key, self.value = (torch.nn.Linear(16, 16) for _ in range(3))

    def forward(self, x):
        x = self.norm(x)
        return self.query(x) + self.key(x) * self.value(x)


def test_shadows_of_one_input_share_its_fake_quantization_with_the_same_sqnrs(monkeypatch):
    """The three projections' shadows quantize the same float value with the same qparams once, not three times."""
    compare_module = __import__("sys").modules["qcore.numeric.compare"]
    torch.manual_seed(0)
    data = batches((4, 8, 16), n=3)
    float_gm, quant_gm = qcore.quantize(_ThreeProjections().eval(), data[0], data)
    erased: list[int] = []

    def shadows(merge: bool) -> dict:
        _run_graph_pass(monkeypatch, "merge_repeated_shadow_inputs", merge, erased)
        _, shadow_records = compare_module.compare_propagated_and_shadow(float_gm, quant_gm, data)
        return {r["layer"]: r["sqnr_db"] for r in shadow_records}

    merged, apart = shadows(merge=True), shadows(merge=False)
    assert merged == apart and set(merged) == {"query", "key", "value"}
    assert erased == [2, 0]  # the key's and the value's copies read the query's


def test_a_screens_shadow_shares_the_layers_own_shadows_weight_quantized_where_read(monkeypatch):
    """In a large model's analysis, weights are quantized where they are read: a screen's copy that quantizes a
    layer's weight as the model's convert did (a screen that changes only the activations) shares the layer's own
    shadow's quantization of it, one pass over the weight a batch instead of two, with the same records."""
    from qcore.graph.capture import clone_graph_module
    from qcore.numeric.compare import ExtraShadows
    from qcore.quantization.convert import quantize_weights_where_read

    compare_module = __import__("sys").modules["qcore.numeric.compare"]
    torch.manual_seed(0)
    data = batches((4, 8, 16), n=3)
    with quantize_weights_where_read():
        float_gm, quant_gm = qcore.quantize(_ThreeProjections().eval(), data[0], data)
    screen = clone_graph_module(quant_gm, share_parameters=True)  # its qparams are copies: equal values
    erased: list[int] = []

    def shadows(merge: bool) -> tuple[dict, dict]:
        _run_graph_pass(monkeypatch, "merge_repeated_shadow_weights", merge, erased)
        extra = ExtraShadows(screen, {"query", "key", "value"})
        _, records = compare_module.compare_propagated_and_shadow(float_gm, quant_gm, data, extra_shadows=[extra])
        return {r["layer"]: r["sqnr_db"] for r in records}, extra.results

    merged, apart = shadows(merge=True), shadows(merge=False)
    assert merged == apart and set(merged[0]) == {"query", "key", "value"}
    assert erased == [3, 0]  # each screen shadow's weight quantization reads the layer's own shadow's


class _WideProjections(torch.nn.Module):
    """Two projections of one input whose weights (2^19 elements) are large against the rows a batch gives them."""

    def __init__(self) -> None:
        super().__init__()
        self.up, self.gate = torch.nn.Linear(1024, 512), torch.nn.Linear(1024, 512, bias=False)

    def forward(self, x):
        return self.up(x) * self.gate(x)


def test_a_screens_shadow_and_the_layers_own_multiply_by_the_weight_read_once_in_one_matmul(monkeypatch):
    """Where weights are quantized where read, a screen's copy that changes only the activations shares the layer's
    own shadow's read of the weight (merge_repeated_shadow_weights), and with few rows both shadows then run as one
    matmul (pair_shadow_matmuls): one matmul a layer a batch fewer, the same records to a row's last bit."""
    from qcore.graph.capture import clone_graph_module
    from qcore.numeric.compare import ExtraShadows
    from qcore.quantization.convert import quantize_weights_where_read
    from tests.helpers import count_op_calls

    compare_module = __import__("sys").modules["qcore.numeric.compare"]
    torch.manual_seed(0)
    data = batches((4, 8, 1024), n=3)  # 32 rows a batch
    with quantize_weights_where_read():
        float_gm, quant_gm = qcore.quantize(_WideProjections().eval(), data[0], data)
    screen = clone_graph_module(quant_gm, share_parameters=True)
    paired: list[int] = []

    def shadows(pair: bool) -> tuple[int, dict, dict]:
        _run_graph_pass(monkeypatch, "pair_shadow_matmuls", pair, paired)
        extra = ExtraShadows(screen, {"up", "gate"})

        def compared():
            return compare_module.compare_propagated_and_shadow(float_gm, quant_gm, data, extra_shadows=[extra])

        addmm, (mm, (_, records)) = count_op_calls(lambda: count_op_calls(compared, torch.ops.aten.mm),
                                                   torch.ops.aten.addmm)
        return addmm + mm, {r["layer"]: r["sqnr_db"] for r in records}, extra.results

    matmuls, own, screened = shadows(pair=True)
    matmuls_apart, own_apart, screened_apart = shadows(pair=False)
    assert paired == [2, 0]  # up's and gate's pairs
    assert matmuls_apart - matmuls == 2 * len(data)
    assert own.keys() == own_apart.keys() == {"up", "gate"}
    for layer in own:
        assert own[layer] == pytest.approx(own_apart[layer], abs=1e-3)
        assert screened[layer]["sqnr_db"] == pytest.approx(screened_apart[layer]["sqnr_db"], abs=1e-3)


class _Heads(torch.nn.Module):
    """An attention block's projections viewed as heads and transposed before scaled_dot_product_attention."""

    def __init__(self) -> None:
        super().__init__()
        self.query, self.key, self.value = (torch.nn.Linear(16, 16) for _ in range(3))
        self.out = torch.nn.Linear(16, 16)

    def forward(self, x):
        def heads(projection):
            return projection(x).view(x.shape[0], x.shape[1], 2, 8).transpose(1, 2)

        attended = torch.nn.functional.scaled_dot_product_attention(heads(self.query), heads(self.key),
                                                                    heads(self.value))
        return self.out(attended.transpose(1, 2).reshape(x.shape))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_quantized_run_skips_requantizing_a_view_of_a_value_on_the_grid_with_the_same_records(monkeypatch, dtype):
    """A projection's output, fake-quantized, viewed as heads and transposed, is not quantized again with the same
    qparams in the quantized graph's run (twice per projection here): the same propagated and shadow records. In
    bfloat16 where each grid was tried and came back (these grids do)."""
    compare_module = __import__("sys").modules["qcore.numeric.compare"]
    torch.manual_seed(0)
    data = [batch.to(dtype) for batch in batches((2, 8, 16), n=3)]
    float_gm, quant_gm = qcore.quantize(_Heads().eval().to(dtype), data[0], data)
    counts: list[int] = []

    def records(skip: bool) -> tuple:
        _run_graph_pass(monkeypatch, "skip_requantizations", skip, counts)
        propagated, shadows = compare_module.compare_propagated_and_shadow(float_gm, quant_gm, data)
        return ([(r["layer"], r["sqnr_db"], r["cosine"]) for r in propagated],
                [(r["layer"], r["sqnr_db"], r["cosine"]) for r in shadows])

    assert records(skip=True) == records(skip=False)
    assert counts == [6, 0]


@settings(max_examples=80, deadline=None)
@given(st.integers(0, 2**31 - 1), st.floats(1e-4, 10.0), st.sampled_from([(-128, 127), (0, 255), (-8, 7)]),
       st.floats(0, 1), st.booleans(), st.sampled_from([torch.bfloat16, torch.float16, torch.float32]))
@example(0, 0.6790452599525452, (-128, 127), 65.5 / 255, False, torch.bfloat16)  # a grid that moves: zero point -62
def test_a_grid_said_to_come_back_is_given_back_by_a_second_fake_quantization(seed, scale, qrange, zp_frac,
                                                                              native_kernels, dtype):
    """grid_comes_back's verdict, against values: where it says so, any value fake-quantized, viewed and fake-quantized
    again with the same qparams is the same bits (NaN stays NaN), either path; where it does not, some grid value
    moves."""
    from unittest import mock

    from qcore.numeric.instrument import grid_comes_back
    from qcore.observe.qparams import fake_quantize_per_tensor
    from qcore.runtime import native

    quant_min, quant_max = qrange
    zero_point = int(quant_min + zp_frac * (quant_max - quant_min))
    scale = float(torch.tensor(scale, dtype=torch.float32))
    comes_back = grid_comes_back(scale, zero_point, quant_min, quant_max, dtype)
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(4, 6, 8, generator=generator) * scale * (quant_max - quant_min)
    x[0, 0, :4] = torch.tensor([float("nan"), -0.0, float("inf"), -float("inf")])
    grid = (torch.arange(quant_min, quant_max + 1, dtype=torch.float32) - zero_point) * scale
    bits = torch.int32 if dtype == torch.float32 else torch.int16
    with mock.patch.dict(native._state, {} if native_kernels else {"library": None}):
        once = fake_quantize_per_tensor(torch.cat([x.reshape(-1), grid]).to(dtype), scale, zero_point, quant_min,
                                        quant_max)
        viewed = once.view(2, -1).t()
        again = fake_quantize_per_tensor(viewed, scale, zero_point, quant_min, quant_max)
        grid_in_dtype = grid.to(dtype)
        grid_again = fake_quantize_per_tensor(grid_in_dtype, scale, zero_point, quant_min, quant_max)
    assert comes_back == torch.equal(grid_again.view(bits), grid_in_dtype.view(bits))
    numbers = ~viewed.isnan()
    if comes_back:
        assert torch.equal(again.isnan(), viewed.isnan())
        assert torch.equal(again[numbers].view(bits), viewed[numbers].view(bits))


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 2**31 - 1), st.floats(1e-4, 10.0), st.integers(-128, 127), st.booleans(),
       st.sampled_from([torch.float32, torch.float16]))
def test_a_value_fake_quantized_again_with_the_same_qparams_is_itself(seed, scale, zero_point, native_kernels, dtype):
    """What skip_requantizations relies on: a fake-quantized int8 value, viewed and fake-quantized again with the
    same qparams, is the same bits (signs of zero and NaN included), float32 or float16, either path."""
    from unittest import mock

    from qcore.observe.qparams import fake_quantize_per_tensor
    from qcore.runtime import native

    generator = torch.Generator().manual_seed(seed)
    x = (torch.randn(3, 5, 8, generator=generator) * scale * 200).to(dtype)
    x[0, 0, :3] = torch.tensor([float("nan"), -0.0, float("inf")])
    patch = mock.patch.dict(native._state, {} if native_kernels else {"library": None})
    with patch:
        once = fake_quantize_per_tensor(x, scale, zero_point, -128, 127)
        viewed = once.view(3, 5, 2, 4).transpose(1, 2)
        again = fake_quantize_per_tensor(viewed, scale, zero_point, -128, 127)
    same = (again == viewed) | (again.isnan() & viewed.isnan())
    assert bool(same.all()) and torch.equal(again.signbit(), viewed.signbit())


class _DoubledInPlace(torch.nn.Module):
    def forward(self, x):
        return x.mul_(2.0)


def test_a_quantized_layer_value_is_queued_as_it_is_where_nothing_changes_it(monkeypatch):
    """A quantized layer's value is its output's fake quantization, a new tensor: its comparator holds it, not a
    copy, unless an op writes to it in place (an exported x.mul_ after the last layer)."""
    from qcore.numeric.loggers import StreamingComparator

    compare_module = __import__("sys").modules["qcore.numeric.compare"]
    held = []

    class Recording(StreamingComparator):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            if args:  # a propagated comparator (it reads a stash)
                held.append(kwargs.get("actual_held", False))

    monkeypatch.setattr(compare_module, "StreamingComparator", Recording)
    verdicts = {}
    for written in (False, True):
        layers = [torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4)]
        model = torch.nn.Sequential(*layers, *([_DoubledInPlace()] if written else []))
        data = batches((2, 8), n=2)
        float_gm, quant_gm = qcore.quantize(model.eval(), data[0], data)
        held.clear()
        propagated, _ = compare_module.compare_propagated_and_shadow(float_gm, quant_gm, data)
        verdicts[written] = list(held)
        assert all(record["sqnr_db"] > 20 for record in propagated)
    assert verdicts == {False: [True, True], True: [True, False]}
