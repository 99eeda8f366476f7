"""Reused output buffers for large short-lived CPU values (qcore.runtime.scratch): handed out again only once nothing
holds them, and the analyses that use them give the same numbers."""
from unittest import mock

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import qcore
from qcore.analysis import AnalysisPlan, ModelAnalysis
from qcore.observe.qparams import KeptRowArguments, fake_quantize_per_channel
from qcore.observe.segmented import fake_quantize_experts_where_read
from qcore.quantization.convert import fake_quantize_where_read, quantize_weights_where_read
from qcore.runtime import native, scratch
from qcore.search.sensitivity import SwitchableModel
from tests.helpers import count_aten_ops
from tests.models import tiny_llama

pytestmark = pytest.mark.skipif(native.kernel() is None, reason="the pool serves the CPU path with qcore's native "
                                "kernels; the torch path stands for a GPU")

LARGE = (1024, 512)  # 2 MiB in float32: above scratch.MIN_REUSED_BYTES


def test_a_buffer_is_handed_out_again_only_once_nothing_holds_it():
    x = torch.randn(LARGE)
    with scratch.reused_outputs():
        first = scratch.reused_like(x)
        pointer = first.data_ptr()
        view = first.t()  # a view keeps the storage: the buffer is not free
        del first
        second = scratch.reused_like(x)
        assert second.data_ptr() != pointer and second.shape == x.shape and second.is_contiguous()
        del view
        del second
        third = scratch.reused_like(x)  # both are free now: the first one pooled
        assert third.data_ptr() == pointer
        del third
        ops, third = count_aten_ops(lambda: scratch.reused_like(x))
        assert ops == 1 and third.data_ptr() == pointer  # one op, as torch.empty_like: the op count is unchanged
        held = scratch.reused_like(x)
        extra = scratch.reused_like(x)  # two are pooled per shape and both are held: a fresh one
        assert len({third.data_ptr(), held.data_ptr(), extra.data_ptr()}) == 3


def test_no_buffer_is_reused_outside_the_block_for_small_or_half_precision_tensors_or_under_autograd():
    x = torch.randn(LARGE)
    assert scratch.reused_like(x) is None
    with scratch.reused_outputs():
        assert scratch.reused_like(torch.randn(8, 8)) is None
        with torch.enable_grad():
            assert scratch.reused_like(x.requires_grad_()) is None
        assert scratch.reused_like(torch.randn(LARGE, dtype=torch.bfloat16)) is None  # float32 only
        with mock.patch.dict(native._state, {"library": None}):  # the torch path, as on a GPU: no pool, no extra op
            assert scratch.reused_like(x.detach()) is None


def test_elementwise_gives_the_values_of_the_op_and_leaves_what_it_cannot_write_over_to_the_op():
    x, columns, rows = torch.randn(LARGE), torch.rand(1, LARGE[1]) + 0.5, torch.rand(LARGE[0], 1) + 0.5
    with scratch.reused_outputs():
        kept = scratch.elementwise(torch.mul, x, columns)
        again = scratch.elementwise(torch.div, x, rows)  # `kept` is held: another buffer
        assert torch.equal(kept, x * columns) and torch.equal(again, x / rows)
        assert kept.data_ptr() != again.data_ptr()
        wider = scratch.elementwise(torch.mul, torch.randn(1, LARGE[1]), torch.randn(LARGE))  # broadcast to other's
        assert wider.shape == LARGE
        promoted = scratch.elementwise(torch.mul, x, columns.double())
        assert promoted.dtype == torch.float64


@settings(max_examples=20, deadline=None)
@given(rows=st.integers(1, 600), more_columns=st.integers(0, 64), lines=st.sampled_from(["columns", "rows", "flat"]),
       divide=st.booleans(), specials=st.booleans(), seed=st.integers(0, 2**16))
def test_a_matrix_scaled_by_columns_or_rows_in_the_native_kernel_is_torchs_mul_and_div_to_the_bit(
        rows, more_columns, lines, divide, specials, seed):
    """A weight rewritten where it is read (equalization, smoothing) is scaled in one native pass into a reused
    buffer, with no torch op, and gives torch's values bit for bit: NaN, infinities, signed zeros and subnormals
    in the weight and in the factors included."""
    from torch.utils._python_dispatch import TorchDispatchMode

    columns = -(-scratch.MIN_REUSED_BYTES // (4 * rows)) + more_columns  # 1 MiB or more: the pool's sizes
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, columns, generator=generator)
    factor = torch.rand((rows, 1) if lines == "rows" else (columns,) if lines == "flat" else (1, columns),
                        generator=generator) + 0.25
    if specials:
        for tensor in (x.view(-1), factor.view(-1)):
            picked = torch.randint(0, tensor.numel(), (6,), generator=generator)
            tensor[picked] = torch.tensor([float("nan"), float("inf"), -float("inf"), 0.0, -0.0, 1e-41])
    op = torch.div if divide else torch.mul
    dispatched = []

    class Recorder(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            dispatched.append(str(func))
            return func(*args, **(kwargs or {}))

    with scratch.reused_outputs():
        with Recorder():
            scaled = scratch.elementwise(op, x, factor)
        assert not [name for name in dispatched if "div" in name or "mul" in name]
        assert torch.equal(scaled.view(torch.int32), op(x, factor).view(torch.int32))


@given(shape=st.lists(st.integers(0, 3), max_size=4), target=st.lists(st.integers(0, 3), max_size=4))
def test_broadcasts_to_is_torchs_broadcast_keeping_the_target(shape, target):
    try:
        keeps = torch.broadcast_shapes(tuple(target), tuple(shape)) == tuple(target)
    except RuntimeError:
        keeps = False
    assert scratch.broadcasts_to(shape, target) == keeps


def test_a_weight_quantized_where_read_into_reused_buffers_keeps_the_values_it_gave():
    torch.manual_seed(0)
    weights = [torch.randn(LARGE) for _ in range(3)]
    scale = torch.rand(LARGE[0]) * 0.02 + 0.005
    zero_point = torch.zeros(LARGE[0], dtype=torch.int64)
    expected = [fake_quantize_per_channel(w, scale, zero_point, 0, -127, 127) for w in weights]
    with scratch.reused_outputs():
        held = [fake_quantize_where_read(w, scale, zero_point, 0, -127, 127) for w in weights]
        assert all(torch.equal(a, b) for a, b in zip(held, expected))  # three held at once: none written over
        del held
        pointers = set()
        for w, value in zip(weights, expected):  # one at a time: one buffer serves them all
            result = fake_quantize_where_read(w, scale, zero_point, 0, -127, 127)
            assert torch.equal(result, value)
            pointers.add(result.data_ptr())
            del result
        assert len(pointers) == 1


@settings(max_examples=25, deadline=None)
@given(rows=st.integers(1, 40), columns=st.integers(1, 70), bits=st.sampled_from([4, 8]),
       affine=st.booleans(), seed=st.integers(0, 2**16))
def test_a_weight_quantized_where_read_with_kept_kernel_arguments_is_torch_aos_fake_quantization(
        rows, columns, bits, affine, seed):
    """The kernel's arguments are made once per scale and zero point and kept: every read, and a read after the
    qparams changed in place, gives torch's fake_quantize_per_channel_affine of the weight, bit for bit."""
    generator = torch.Generator().manual_seed(seed)
    weight = torch.randn(rows, columns, generator=generator) * 0.05
    quant_min, quant_max = (0, 2**bits - 1) if affine else (-(2 ** (bits - 1)) + 1, 2 ** (bits - 1) - 1)
    scale = torch.rand(rows, generator=generator) * 0.01 + 1e-3
    zero_point = (torch.randint(quant_min, quant_max + 1, (rows,), generator=generator) if affine
                  else torch.zeros(rows, dtype=torch.int64))

    def expected() -> torch.Tensor:
        return torch.fake_quantize_per_channel_affine(weight, scale, zero_point.int(), 0, quant_min, quant_max)

    for _ in range(2):  # the second read takes the kept arguments
        assert torch.equal(fake_quantize_where_read(weight, scale, zero_point, 0, quant_min, quant_max), expected())
    scale.mul_(1.5)  # the qparams move: their versions do, and the kept arguments are made again
    zero_point.copy_(zero_point.flip(0))
    assert torch.equal(fake_quantize_where_read(weight, scale, zero_point, 0, quant_min, quant_max), expected())
    other = scale.clone() * 0.5  # another scale tensor has arguments of its own
    assert torch.equal(fake_quantize_where_read(weight, other, zero_point, 0, quant_min, quant_max),
                       torch.fake_quantize_per_channel_affine(weight, other, zero_point.int(), 0, quant_min, quant_max))


@settings(max_examples=25, deadline=None)
@given(experts=st.integers(1, 6), rows=st.integers(1, 24), columns=st.integers(1, 40), bits=st.sampled_from([4, 8]),
       affine=st.booleans(), per_tensor=st.booleans(), seed=st.integers(0, 2**16))
def test_a_grouped_weight_quantized_where_read_with_kept_kernel_arguments_is_torch_aos_per_expert(
        experts, rows, columns, bits, affine, per_tensor, seed):
    """A grouped projection's [E, out, in] weight quantized where read, expert by expert, with the kernel's arguments
    of every expert made once per qparams: each expert's weight is torch's fake quantization of it with its own
    qparams (per output channel, or per tensor), bit for bit, on every read and after the qparams change in place;
    an expert kept in float reads its float slice."""
    generator = torch.Generator().manual_seed(seed)
    weight = torch.randn(experts, rows, columns, generator=generator) * 0.05
    quant_min, quant_max = (0, 2**bits - 1) if affine else (-(2 ** (bits - 1)) + 1, 2 ** (bits - 1) - 1)
    shape = (experts,) if per_tensor else (experts, rows)
    scale = torch.rand(shape, generator=generator) * 0.01 + 1e-3
    zero_point = (torch.randint(quant_min, quant_max + 1, shape, generator=generator) if affine
                  else torch.zeros(shape, dtype=torch.int64))
    kept_float = (experts - 1,) if experts > 1 else ()

    def expected(expert: int) -> torch.Tensor:
        if expert in kept_float:
            return weight[expert]
        if per_tensor:
            return torch.fake_quantize_per_tensor_affine(weight[expert], float(scale[expert]),
                                                         int(zero_point[expert]), quant_min, quant_max)
        return torch.fake_quantize_per_channel_affine(weight[expert], scale[expert], zero_point[expert].int(), 0,
                                                      quant_min, quant_max)

    for _ in range(2):  # the second read takes the kept arguments
        read = fake_quantize_experts_where_read(weight, scale, zero_point, quant_min, quant_max, kept_float)
        assert all(torch.equal(read.expert(expert), expected(expert)) for expert in range(experts))
    scale.mul_(1.5)  # the qparams move: their versions do, and the kept arguments are made again
    zero_point.copy_(zero_point.flip(0))
    read = fake_quantize_experts_where_read(weight, scale, zero_point, quant_min, quant_max, kept_float)
    assert all(torch.equal(read.expert(expert), expected(expert)) for expert in range(experts))


def test_kept_kernel_arguments_are_for_the_same_tensors_only_and_bounded():
    """An entry answers only for the very scale and zero point it was made from (not a later tensor at the same
    address), and the kept entries stay within their limit."""
    kept = KeptRowArguments(limit=3)
    weight = torch.randn(8, 16)
    scales = [torch.full((8,), 0.01 * (i + 1)) for i in range(5)]
    zero_point = torch.zeros(8, dtype=torch.int64)
    made = [kept.arguments(weight, scale, zero_point, 0, -127, 127) for scale in scales]
    assert all(arguments is not None for arguments in made) and len(kept._kept) <= 3
    assert kept.arguments(weight, scales[-1], zero_point, 0, -127, 127) is made[-1]  # kept: the same tensors
    assert kept.arguments(weight, scales[-1], zero_point, 0, -100, 100) is not made[-1]  # other bounds
    assert kept.arguments(weight, scales[-1], zero_point.float(), 0, -127, 127) is None  # float zero points
    assert kept.arguments(weight.t(), scales[-1][:1].expand(16), zero_point[:1].expand(16), 1, -127, 127) is None
    replaced = torch.full((8,), 0.5)
    entry = kept._kept[(id(scales[-1]), id(zero_point))]
    kept._kept[(id(replaced), id(zero_point))] = entry  # as if `replaced` lived where scales[-1] was
    assert kept.arguments(weight, replaced, zero_point, 0, -127, 127) is not entry[3]


def test_kept_kernel_arguments_go_with_their_scale():
    """An entry does not outlive the scale it was made for: a long session's dropped graphs leave none behind."""
    kept = KeptRowArguments()
    weight, zero_point = torch.randn(8, 16), torch.zeros(8, dtype=torch.int64)
    scales = [torch.full((8,), 0.01 * (i + 1)) for i in range(3)]
    for scale in scales:
        assert kept.arguments(weight, scale, zero_point, 0, -127, 127) is not None
    assert len(kept._kept) == 3
    del scale, scales[0]
    assert len(kept._kept) == 2
    assert kept.arguments(weight, scales[0], zero_point, 0, -127, 127) is not None and len(kept._kept) == 2


@pytest.fixture
def every_weight_reused(monkeypatch):
    """Tiny models' weights go through the pool too."""
    monkeypatch.setattr(scratch, "MIN_REUSED_BYTES", 0)


def test_an_analysis_quantized_where_read_into_reused_buffers_equals_the_one_with_quantized_copies(
        every_weight_reused):
    pytest.importorskip("transformers")
    model, batches = tiny_llama(layers=2, batch=2)
    float_gm = qcore.capture(model, batches[0])
    plan = AnalysisPlan(measurements=frozenset({"sqnr", "equalization", "logits"}))
    plain = ModelAnalysis(float_gm, batches=batches, plan=plan)
    settings = ([], ["model.layers.0.self_attn.q_proj", "lm_head"], None)
    plain_switches = SwitchableModel(float_gm, batches)
    expected = []
    for kept in settings:
        plain_switches.quantize_only(plain_switches.layers if kept is None else kept)
        expected.append(plain_switches.run(batches))
    with quantize_weights_where_read():
        reused = ModelAnalysis(float_gm, batches=batches, plan=plan)
        measured = reused.measurement
        trial = reused.variant(equalize="smooth:search").sqnr
        switches = SwitchableModel(float_gm, batches)
        found = []
        for kept in settings:
            switches.quantize_only(switches.layers if kept is None else kept)
            found.append(switches.run(batches))
    assert found == expected
    assert measured.sqnr == plain.measurement.sqnr and measured.variants == plain.measurement.variants
    assert measured.logits == plain.measurement.logits
    assert trial == plain.variant(equalize="smooth:search").sqnr
