"""Observers of every expert at once against torch.ao's observer of each expert's own Linear (a histogram: qcore's),
fed the rows routed to that expert only; one per-row fake quantization against one per-tensor fake quantization per
expert."""
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.ao.quantization import observer as ao

from qcore.observe.qparams import fake_quantize_per_tensor
from qcore.observe.segmented import (
    SegmentedMinMaxObserver,
    SegmentedMovingAverageMinMaxObserver,
    SegmentedPerChannelMinMaxObserver,
    fake_quantize_per_expert,
)

EXPERTS = 5


def _routed_batches(seed: int, batches: int, features: int = 6, never: int | None = 3):
    """[(rows sorted by expert, counts)]: random runs, some empty; expert `never` reached by no batch."""
    generator = torch.Generator().manual_seed(seed)
    found = []
    for index in range(batches):
        counts = torch.randint(0, 5, (EXPERTS,), generator=generator)
        if never is not None:
            counts[never] = 0
        rows = torch.randn(int(counts.sum()), features, generator=generator) * (index + 1)
        found.append((rows, counts))
    return found


def _per_expert_references(make, batches):
    """torch.ao's observer per expert, each called with its expert's run of each batch (an empty run included:
    torch.ao's observers leave their range as it is on an empty tensor)."""
    references = [make() for _ in range(EXPERTS)]
    for rows, counts in batches:
        for expert, run in enumerate(rows.split(counts.tolist())):
            references[expert](run)
    return references


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**16), batches=st.integers(1, 6),
       scheme=st.sampled_from([(torch.per_tensor_affine, torch.quint8), (torch.per_tensor_symmetric, torch.qint8)]))
def test_minmax_per_expert_matches_torch_ao(seed, batches, scheme):
    qscheme, ao_dtype = scheme
    data = _routed_batches(seed, batches)
    ours = SegmentedMinMaxObserver(EXPERTS, dtype=torch.uint8 if ao_dtype == torch.quint8 else torch.int8,
                                   qscheme=qscheme)
    for rows, counts in data:
        assert ours(rows, counts) is rows
    references = _per_expert_references(lambda: ao.MinMaxObserver(dtype=ao_dtype, qscheme=qscheme), data)
    scale, zero_point = ours.calculate_qparams()
    observed = ours.observed.tolist()
    for expert, reference in enumerate(references):
        assert float(ours.min_val[expert]) == float(reference.min_val)
        assert float(ours.max_val[expert]) == float(reference.max_val)
        assert observed[expert] == bool(torch.isfinite(reference.min_val))
        if observed[expert]:
            ref_scale, ref_zero_point = reference.calculate_qparams()
            assert float(scale[expert]) == float(ref_scale) and int(zero_point[expert]) == int(ref_zero_point)
        else:  # no token reached it: what convert gives a tensor calibration never reached
            assert float(scale[expert]) == 1.0 and int(zero_point[expert]) == 0


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**16), batches=st.integers(1, 6), constant=st.sampled_from([0.01, 0.1, 0.5]))
def test_moving_average_per_expert_matches_torch_ao(seed, batches, constant):
    data = _routed_batches(seed, batches)
    ours = SegmentedMovingAverageMinMaxObserver(EXPERTS, averaging_constant=constant)
    for rows, counts in data:
        ours(rows, counts)
    references = _per_expert_references(
        lambda: ao.MovingAverageMinMaxObserver(averaging_constant=constant, dtype=torch.qint8), data)
    for expert, reference in enumerate(references):
        assert float(ours.min_val[expert]) == float(reference.min_val)
        assert float(ours.max_val[expert]) == float(reference.max_val)


@settings(max_examples=20, deadline=None)
@given(seed=st.integers(0, 2**16), batches=st.integers(1, 5))
def test_per_channel_activation_per_expert_matches_torch_ao(seed, batches):
    data = _routed_batches(seed, batches, never=None)
    ours = SegmentedPerChannelMinMaxObserver(EXPERTS, ch_axis=1, quant_min=-127, quant_max=127)
    for rows, counts in data:
        ours(rows, counts)
    references = _per_expert_references(lambda: ao.PerChannelMinMaxObserver(
        ch_axis=1, dtype=torch.qint8, qscheme=torch.per_channel_symmetric, quant_min=-127, quant_max=127), data)
    scale, zero_point = ours.calculate_qparams()
    observed = ours.observed.tolist()
    for expert, reference in enumerate(references):
        if reference.min_val.numel() == 0:  # torch.ao's per-channel observer saw no row of this expert
            assert not observed[expert]
            continue
        assert observed[expert]
        assert torch.equal(ours.min_val[expert], reference.min_val)
        assert torch.equal(ours.max_val[expert], reference.max_val)
        ref_scale, ref_zero_point = reference.calculate_qparams()
        assert torch.equal(scale[expert], ref_scale) and torch.equal(zero_point[expert], ref_zero_point)


@pytest.mark.parametrize("axis", [0, 1])
def test_per_channel_weights_per_expert_match_torch_ao(axis):
    """A fused [E, out, in] parameter observed once: each expert's weight as torch.ao's weight observer sees it."""
    weight = torch.randn(EXPERTS, 12, 8, generator=torch.Generator().manual_seed(1))
    ours = SegmentedPerChannelMinMaxObserver(EXPERTS, ch_axis=axis, quant_min=-127, quant_max=127)
    ours.observe_constant(weight)
    ours.observe_constant(weight * 2)  # once only, as a weight is
    scale, zero_point = ours.calculate_qparams()
    for expert in range(EXPERTS):
        reference = ao.PerChannelMinMaxObserver(ch_axis=axis, dtype=torch.qint8, qscheme=torch.per_channel_symmetric,
                                                quant_min=-127, quant_max=127)
        reference(weight[expert])
        ref_scale, ref_zero_point = reference.calculate_qparams()
        assert torch.equal(scale[expert], ref_scale) and torch.equal(zero_point[expert], ref_zero_point)


@pytest.mark.parametrize("kind", ["minmax", "per-channel", "histogram-per-expert"])
def test_a_weight_observed_a_few_experts_at_a_time_gives_each_expert_its_weights_qparams(kind):
    """observe_constant_in_parts (an equalization variant's divided weight, made a few experts at a time): each
    expert's qparams as torch.ao's weight observer gives them for that expert's weight alone (qcore's histogram:
    as observing the whole weight at once gives them)."""
    from qcore.observe.observers import HistogramObserver
    from qcore.observe.segmented import PerExpertObservers

    weight = torch.randn(EXPERTS, 12, 8, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)

    def make():
        if kind == "minmax":
            return SegmentedMinMaxObserver(EXPERTS, quant_min=-127, quant_max=127, qscheme=torch.per_tensor_symmetric)
        if kind == "per-channel":
            return SegmentedPerChannelMinMaxObserver(EXPERTS, ch_axis=0, quant_min=-127, quant_max=127)
        return PerExpertObservers([HistogramObserver(quant_min=-127, quant_max=127) for _ in range(EXPERTS)])

    parts = make()
    parts.observe_constant_in_parts(weight[start:start + 2] for start in range(0, EXPERTS, 2))
    scale, zero_point = parts.calculate_qparams()
    with pytest.raises(ValueError):  # parts that leave experts out
        make().observe_constant_in_parts([weight[:2]])
    if kind == "histogram-per-expert":
        whole = make()
        whole.observe_constant(weight)
        whole_scale, whole_zero_point = whole.calculate_qparams()
        assert torch.equal(scale, whole_scale) and torch.equal(zero_point, whole_zero_point)
        return
    for expert in range(EXPERTS):
        reference = ao.MinMaxObserver(dtype=torch.qint8, qscheme=torch.per_tensor_symmetric, quant_min=-127,
                                      quant_max=127) if kind == "minmax" else ao.PerChannelMinMaxObserver(
            ch_axis=0, dtype=torch.qint8, qscheme=torch.per_channel_symmetric, quant_min=-127, quant_max=127)
        reference(weight[expert].float())
        ref_scale, ref_zero_point = reference.calculate_qparams()
        assert torch.equal(scale[expert].reshape(ref_scale.shape), ref_scale)
        assert torch.equal(zero_point[expert].reshape(ref_zero_point.shape).to(ref_zero_point.dtype), ref_zero_point)


def test_a_nan_stays_in_its_experts_range_alone():
    rows = torch.tensor([[1.0, 2.0], [float("nan"), 0.0], [3.0, -4.0]])
    ours = SegmentedMinMaxObserver(3)
    ours(rows, torch.tensor([1, 1, 1]))
    assert ours.min_val.isnan().tolist() == [False, True, False]
    assert ours.observed.tolist() == [True, True, True]


def test_counts_of_another_block_are_refused():
    with pytest.raises(ValueError, match="keeps 5 experts"):
        SegmentedMinMaxObserver(EXPERTS)(torch.randn(4, 3), torch.tensor([2, 2]))
    with pytest.raises(ValueError, match=r"not \[experts, out, in\]"):
        SegmentedPerChannelMinMaxObserver(EXPERTS, ch_axis=0).observe_constant(torch.randn(4, 3))


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**16), scheme=st.sampled_from([(-128, 127), (0, 255), (-127, 127)]),
       dtype=st.sampled_from([torch.float32, torch.bfloat16]))
def test_fake_quantize_per_expert_is_one_per_tensor_fake_quantization_per_expert(seed, scheme, dtype):
    quant_min, quant_max = scheme
    generator = torch.Generator().manual_seed(seed)
    counts = torch.randint(0, 40, (EXPERTS,), generator=generator)
    rows = (torch.randn(int(counts.sum()), 24, generator=generator) * 3).to(dtype)
    scale = torch.rand(EXPERTS, generator=generator) * 0.05 + 1e-3
    zero_point = torch.randint(quant_min, quant_max + 1, (EXPERTS,), generator=generator)
    if quant_min < 0:
        zero_point.zero_()
    found = fake_quantize_per_expert(rows, counts, scale, zero_point, quant_min, quant_max)
    for expert, (run, part) in enumerate(zip(rows.split(counts.tolist()), found.split(counts.tolist()), strict=True)):
        ours = fake_quantize_per_tensor(run, float(scale[expert]), int(zero_point[expert]), quant_min, quant_max)
        torch_ao = torch.fake_quantize_per_tensor_affine(run.float(), float(scale[expert]), int(zero_point[expert]),
                                                         quant_min, quant_max).to(dtype)
        assert torch.equal(part, ours)
        assert torch.equal(part, torch_ao)


def test_the_run_kernel_takes_only_counts_that_are_the_rows_runs():
    from qcore.observe.qparams import fake_quantize_by_run
    from qcore.runtime import native

    if native.kernel() is None:
        pytest.skip(f"no native kernel here: {native.status()}")
    scale, zero_point = torch.full((2,), 0.1), torch.zeros(2, dtype=torch.long)
    rows = torch.randn(5, 3)
    for counts in (torch.tensor([2, 2]), torch.tensor([6, -1])):
        with pytest.raises(ValueError, match="are not runs of the 5 rows"):
            fake_quantize_by_run(rows, counts, scale, zero_point, -128, 127)
    kernel = fake_quantize_by_run(rows, torch.tensor([0, 5]), scale, zero_point, -128, 127)
    assert kernel is not None and torch.equal(kernel, fake_quantize_per_tensor(rows, 0.1, 0, -128, 127))


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**16), per_channel=st.booleans(), kept=st.sets(st.integers(0, EXPERTS - 1), max_size=2),
       divided=st.booleans(), empty=st.integers(0, EXPERTS - 1))
def test_an_expert_weight_quantized_where_read_is_torch_aos_per_expert_fake_quantization(seed, per_channel, kept,
                                                                                        divided, empty):
    """A grouped projection's weight quantized where read (each expert's qparams; some experts kept in float; an
    equalization variant's columns divided first), read whole and through grouped_linear (expert by expert inside
    the op, an expert with no row skipped): torch.ao's fake quantization of each expert's weight, and each expert's
    F.linear of its rows with it."""
    from qcore.graph.grouped import grouped_linear
    from qcore.observe.segmented import (
        ExpertsQuantizedWhereRead,
        fake_quantize_divided_experts,
        fake_quantize_experts_where_read,
    )

    generator = torch.Generator().manual_seed(seed)
    fused = torch.randn(EXPERTS, 24, 16, generator=generator)
    weight = fused[:, :12]  # the gate half of a fused gate_up parameter: a view, not contiguous
    factor = torch.rand(EXPERTS, 16, generator=generator) + 0.5
    scale = torch.rand((EXPERTS, 12) if per_channel else (EXPERTS,), generator=generator) * 0.05 + 1e-3
    zero_point = torch.zeros(scale.shape, dtype=torch.long)
    kept_float = tuple(sorted(kept))
    if divided:
        lazy = fake_quantize_divided_experts(weight, factor, scale, zero_point, -128, 127)
        kept = set()
    else:
        lazy = fake_quantize_experts_where_read(weight, scale, zero_point, -128, 127, kept_float)
    assert isinstance(lazy, ExpertsQuantizedWhereRead)
    expected = []
    for expert in range(EXPERTS):
        values = weight[expert] / factor[expert] if divided else weight[expert]
        channel_scale = scale[expert] if per_channel else scale[expert].expand(12)
        expected.append(values if expert in kept else torch.fake_quantize_per_channel_affine(
            values, channel_scale, torch.zeros(12, dtype=torch.int32), 0, -128, 127))
    expected = torch.stack(expected)
    assert torch.equal(lazy + 0, expected)  # any other op reads it whole
    counts = torch.randint(1, 4, (EXPERTS,), generator=generator)
    counts[empty] = 0
    rows = torch.randn(int(counts.sum()), 16, generator=generator)
    found = grouped_linear(rows, counts, lazy)
    assert torch.equal(found, grouped_linear(rows, counts, expected))


def test_one_observer_per_expert_gives_each_expert_its_own_histograms_qparams():
    """An observer without a form over every expert (a histogram): one per expert, each fed its expert's rows, gives
    each expert the qparams of the histogram observer of its Linear alone (qcore's, whose search
    test_observers.py checks against torch.ao's), bit for bit; those of an expert no batch reached are convert's
    scale 1 and zero point 0."""
    from qcore.observe.observers import HistogramObserver
    from qcore.observe.segmented import PerExpertObservers, segmented_observer

    data = _routed_batches(7, 4, features=64)
    ours = segmented_observer(HistogramObserver, EXPERTS, dtype=torch.int8, quant_min=-128, quant_max=127)
    assert isinstance(ours, PerExpertObservers)
    for rows, counts in data:
        ours(rows, counts)
    references = _per_expert_references(lambda: HistogramObserver(dtype=torch.int8, quant_min=-128, quant_max=127),
                                        data)
    scale, zero_point = ours.calculate_qparams()
    assert ours.observed.tolist() == [expert != 3 for expert in range(EXPERTS)]
    for expert, reference in enumerate(references):
        if expert == 3:
            assert float(scale[expert]) == 1.0 and int(zero_point[expert]) == 0
            continue
        ref_scale, ref_zero_point = reference.calculate_qparams()
        assert float(scale[expert]) == float(ref_scale) and int(zero_point[expert]) == int(ref_zero_point)


def test_a_fresh_copy_of_an_observer_of_every_expert_has_seen_no_expert():
    """A trial's observers start from fresh copies of the model's: every expert's range as before any row."""
    from qcore.observe.observers import fresh_copy

    ours = SegmentedMinMaxObserver(EXPERTS)
    for rows, counts in _routed_batches(0, 2):
        ours(rows, counts)
    fresh = fresh_copy(ours)
    assert fresh.min_val.shape == (EXPERTS,) and not fresh.observed.any()
    assert ours.observed.any()  # the original as it was
    rows, counts = _routed_batches(1, 1)[0]
    fresh(rows, counts)
    reference = SegmentedMinMaxObserver(EXPERTS)
    reference(rows, counts)
    assert torch.equal(fresh.min_val, reference.min_val) and torch.equal(fresh.max_val, reference.max_val)


def test_a_fresh_copy_of_one_observer_per_expert_makes_each_anew():
    from qcore.observe.observers import HistogramObserver, fresh_copy
    from qcore.observe.segmented import segmented_observer

    ours = segmented_observer(HistogramObserver, EXPERTS, dtype=torch.int8, quant_min=-128, quant_max=127)
    for rows, counts in _routed_batches(0, 2, features=64):
        ours(rows, counts)
    fresh = fresh_copy(ours)
    assert not fresh.observed.any() and ours.observed.any()
    assert all(a is not b for a, b in zip(fresh.per_expert, ours.per_expert))
