"""The report observer's native kernel computes exactly what its torch path computes."""
import copy
import os
import pickle

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from qcore.report.observer import ReportObserver
from qcore.runtime import native

needs_kernel = pytest.mark.skipif(native.kernel() is None, reason=f"no native kernel here: {native.status()}")
STATE = ("extremes", "extreme_sums", "min_val", "max_val", "ratio_sums", "ratio_counts", "constant_channels")


def _torch_path(monkeypatch):
    monkeypatch.setattr(native, "kernel", lambda: None)


def _observe(batches, **settings_):
    observer = ReportObserver(**settings_)
    for batch in batches:
        observer(batch)
    return observer


def _assert_same_state(native_observer, torch_observer):
    assert native_observer.num_batches_tracked == torch_observer.num_batches_tracked
    for name in STATE:
        ours, reference = getattr(native_observer, name), getattr(torch_observer, name)
        assert ours.dtype == reference.dtype and torch.equal(ours.nan_to_num(7.0), reference.nan_to_num(7.0)), name


@st.composite
def activations(draw):
    """Batches that stress the selection: ties, all-zero and constant channels, infinities, sorted runs."""
    layout = draw(st.sampled_from(["rows", "rows3d", "conv"]))
    channels = draw(st.integers(1, 40))
    if layout == "rows":
        shape, axis = (draw(st.integers(1, 700)), channels), -1
    elif layout == "rows3d":
        shape, axis = (draw(st.integers(1, 4)), draw(st.integers(1, 90)), channels), -1
    else:
        shape, axis = (draw(st.integers(1, 3)), channels, draw(st.integers(1, 9)), draw(st.integers(1, 9))), 1
    kind = draw(st.sampled_from(["normal", "ties", "relu", "sorted", "extreme"]))
    seed = draw(st.integers(0, 2**16))
    strided = draw(st.booleans())
    generator = torch.Generator().manual_seed(seed)
    batches = []
    for _ in range(draw(st.integers(1, 3))):
        x = torch.randn(shape, generator=generator)
        if kind == "ties":
            x = x.mul(2).round()
        elif kind == "relu":
            x = x.relu()
            x.select(axis, 0).zero_()
        elif kind == "sorted":
            x = x.flatten().sort(descending=seed % 2 == 0).values.reshape(shape)
        elif kind == "extreme":
            x.view(-1)[:: max(1, x.numel() // 5)] = float("inf")
            x.select(axis, channels - 1).fill_(-3.0)  # a constant channel
        # strided: the same values in a transposed memory layout (attention's keys), which the kernel copies
        batches.append(x.transpose(0, -1).contiguous().transpose(0, -1) if strided else x.contiguous())
    percentiles = draw(st.sampled_from([(), (0.975,), (0.9, 0.99), (0.5,), (0.0, 1.0)]))
    per_channel = draw(st.booleans()) or bool(percentiles)
    sample_size = draw(st.sampled_from([4096, 50]))  # 50: channel-major channels are sampled, as in the torch path
    return batches, dict(ch_axis=axis, percentiles=percentiles, per_channel=per_channel, sample_size=sample_size)


@needs_kernel
@settings(max_examples=150, deadline=None)
@given(activations())
def test_native_kernel_equals_torch_path(case):
    batches, observer_settings = case
    native_observer = _observe(batches, **observer_settings)
    with pytest.MonkeyPatch.context() as patch:
        _torch_path(patch)
        torch_observer = _observe(batches, **observer_settings)
    _assert_same_state(native_observer, torch_observer)


@needs_kernel
@settings(max_examples=80, deadline=None)
@given(rows=st.lists(st.integers(1, 600), min_size=2, max_size=6), channels=st.integers(1, 40),
       percentiles=st.sampled_from([(), (0.975,), (0.9, 0.99)]), sample_size=st.sampled_from([4096, 50]),
       seed=st.integers(0, 2**16))
def test_a_token_count_that_changes_every_batch_plans_again_to_the_torch_paths_state(rows, channels, percentiles,
                                                                                      sample_size, seed):
    """An MoE expert's activations have as many rows as tokens were routed to it, a new count every batch: each plan
    reuses the last one's picks and scratch where they fit, and the state is the torch path's."""
    generator = torch.Generator().manual_seed(seed)
    batches = [torch.randn(count, channels, generator=generator) for count in rows]
    observer_settings = dict(ch_axis=-1, percentiles=percentiles, per_channel=True, sample_size=sample_size)
    native_observer = _observe(batches, **observer_settings)
    with pytest.MonkeyPatch.context() as patch:
        _torch_path(patch)
        torch_observer = _observe(batches, **observer_settings)
    _assert_same_state(native_observer, torch_observer)


@settings(max_examples=60, deadline=None)
@given(activations())
def test_a_launch_bound_device_reduces_each_channel_in_one_op_to_the_same_state(case):
    """On a GPU (and the torch path standing for it) a batch's per-channel minimum and maximum are one aminmax where
    the CPU takes amin and amax: the same state."""
    from qcore.report import observer as observer_module

    batches, observer_settings = case
    with pytest.MonkeyPatch.context() as patch:
        _torch_path(patch)
        patch.setattr(observer_module, "launch_bound", lambda device: False)
        separate = _observe(batches, **observer_settings)
        patch.setattr(observer_module, "launch_bound", lambda device: True)
        together = _observe(batches, **observer_settings)
    _assert_same_state(together, separate)


@needs_kernel
@pytest.mark.parametrize("shape", [(256, 256), (1000, 48), (2, 128, 96), (4, 32, 12, 12), (4, 6, 48, 48)])
def test_threads_split_the_work_without_changing_the_result(shape, monkeypatch):
    axis = 1 if len(shape) == 4 else -1
    batches = [torch.randn(shape).relu() * (i + 1) for i in range(3)]
    monkeypatch.setattr(native, "PARALLEL_MIN_NUMEL", 0)
    threaded = _observe(batches, ch_axis=axis, percentiles=(0.975,))
    monkeypatch.setattr(native, "PARALLEL_MIN_NUMEL", 1 << 62)
    serial = _observe(batches, ch_axis=axis, percentiles=(0.975,))
    _assert_same_state(threaded, serial)


@needs_kernel
@pytest.mark.parametrize("order", ["random", "crowded"])
def test_native_percentile_is_the_exact_lower_quantile(order):
    x = torch.randn(512, 16) ** 3
    if order == "crowded":  # every channel's largest values in its first rows: the kernel's rescan path
        x = x.sort(dim=0, descending=True).values
    observer = _observe([x], ch_axis=-1, percentiles=(0.975,))
    exact = torch.quantile(x, 0.975, dim=0, interpolation="lower")
    assert observer._native_plan is not None
    torch.testing.assert_close(observer.average_ratios(0.975).float(), x.amax(0) / exact)


@needs_kernel
@pytest.mark.parametrize("order", ["random", "crowded"])
def test_attention_keys_take_the_kernel_with_a_top_k_over_64(order, monkeypatch):
    """Attention's transposed keys, [batch, heads, positions, head_dim] per head_dim channel: 3072 rows, so the
    97.5th percentile needs each channel's 78 largest values. The kernel keeps up to 128, exact."""
    x = torch.randn(4, 64, 12, 32) ** 3
    if order == "crowded":
        x = x.flatten(0, 2).sort(dim=0, descending=True).values.reshape(x.shape)
    batches = [x.transpose(1, 2), x.transpose(1, 2) * 2 - 1]  # strided, as a transpose in the graph leaves them
    native_observer = _observe(batches, ch_axis=-1, percentiles=(0.975,))
    assert native_observer._native_plan is not None
    _torch_path(monkeypatch)
    _assert_same_state(native_observer, _observe(batches, ch_axis=-1, percentiles=(0.975,)))


@needs_kernel
@pytest.mark.parametrize("kind", ["normal", "ties", "sorted", "relu"])
@pytest.mark.parametrize("shape", [(4, 6, 48, 48), (4, 6, 32, 32)])
def test_sampled_conv_percentiles_equal_the_torch_path(kind, shape, monkeypatch):
    """More values per channel than sample_size (48 x 48 x 4): the kernel selects from the torch path's own
    sample. At most sample_size (32 x 32 x 4), but a top k longer than the kernel's lists (k = 410 for the 90th
    percentile): it selects among all of a channel's values, which is exact."""
    x = torch.randn(*shape)
    if kind == "ties":
        x = x.mul(3).round()
    elif kind == "sorted":
        x = x.flatten().sort().values.reshape(x.shape)
    elif kind == "relu":
        x = x.relu()
    batches = [x, x * 2 - 1]
    native_observer = _observe(batches, ch_axis=1, percentiles=(0.9, 0.975))
    assert native_observer._native_plan is not None
    _torch_path(monkeypatch)
    _assert_same_state(native_observer, _observe(batches, ch_axis=1, percentiles=(0.9, 0.975)))


@needs_kernel
def test_a_nan_batch_takes_the_torch_path_and_propagates(monkeypatch):
    clean, dirty = torch.randn(64, 8), torch.randn(64, 8)
    dirty[5, 3] = float("nan")
    native_observer = _observe([clean, dirty, clean], ch_axis=-1, percentiles=(0.975,))
    _torch_path(monkeypatch)
    _assert_same_state(native_observer, _observe([clean, dirty, clean], ch_axis=-1, percentiles=(0.975,)))
    assert torch.isnan(native_observer.min_val[3])


@needs_kernel
@settings(max_examples=40, deadline=None)
@given(rows=st.lists(st.sampled_from([1, 3, 17, 64, 300]), min_size=3, max_size=10),
       percentiles=st.sampled_from([(), (0.975,), (0.9, 0.99)]), seed=st.integers(0, 2**16))
def test_a_token_count_that_comes_back_runs_its_kept_plan_to_the_torch_paths_state(rows, percentiles, seed):
    """An expert's token count of an earlier batch takes the plan made for it then, unless a larger scratch let the
    kept plans go since, and the state is the torch path's: a plan holds the picks and scratch it points into."""
    generator = torch.Generator().manual_seed(seed)
    batches = [torch.randn(count, 24, generator=generator) for count in rows]
    observer_settings = dict(ch_axis=-1, percentiles=percentiles, per_channel=True)
    native_observer = ReportObserver(**observer_settings)
    for batch in batches:
        kept = native_observer._native_plans.get(batch.shape)
        native_observer(batch)
        assert kept is None or native_observer._native_plan is kept
        assert native_observer._native_plans[batch.shape] is native_observer._native_plan
    with pytest.MonkeyPatch.context() as patch:
        _torch_path(patch)
        torch_observer = _observe(batches, **observer_settings)
    _assert_same_state(native_observer, torch_observer)


@needs_kernel
def test_copies_and_pickles_replan_and_keep_counting():
    observer = _observe([torch.randn(32, 8)], ch_axis=-1, percentiles=(0.975,))
    twin = copy.deepcopy(observer)
    thawed = pickle.loads(pickle.dumps(observer))
    for clone in (twin, thawed):
        assert clone._native_plan is None and not clone._native_plans
        clone(torch.randn(32, 8))
        assert clone.num_batches_tracked == 2 and clone._native_plan is not None
    assert observer.num_batches_tracked == 1


@needs_kernel
def test_replacing_a_state_buffer_drops_the_plan():
    observer = _observe([torch.randn(32, 8)], ch_axis=-1)
    observer.min_val = observer.min_val.clone()
    assert observer._native_plan is None and not observer._native_plans
    observer(torch.randn(32, 8))
    assert observer.num_batches_tracked == 2


def test_without_a_compiler_observers_use_the_torch_path(monkeypatch, tmp_path):
    monkeypatch.setenv("CC", str(tmp_path / "no-such-compiler"))
    monkeypatch.setenv("QCORE_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(native, "_state", {})
    assert native.kernel() is None and native.status().startswith("torch path only")
    observer = _observe([torch.randn(16, 4)] * 2, ch_axis=-1, percentiles=(0.975,))
    assert observer.num_batches_tracked == 2 and observer._native_plan is None


def test_disabled_by_environment(monkeypatch):
    monkeypatch.setenv("QCORE_NATIVE", "0")
    monkeypatch.setattr(native, "_state", {})
    assert native.kernel() is None and "QCORE_NATIVE=0" in native.status()


@needs_kernel
def test_build_lands_in_the_cache_atomically(monkeypatch, tmp_path):
    monkeypatch.setenv("QCORE_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(native, "_state", {})
    assert native.kernel() is not None
    built = sorted(path.name for path in tmp_path.iterdir())
    assert len(built) == 2 and built[0].startswith("_kernels-") and built[0].endswith(".so")
    assert built[1] == built[0] + ".sha256"  # the hash the loader checks before it loads a cached build


@needs_kernel
def test_a_tampered_cached_build_is_rebuilt_before_it_is_loaded(monkeypatch, tmp_path):
    monkeypatch.setenv("QCORE_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(native, "_state", {})
    assert native.kernel() is not None
    library = next(tmp_path.glob("*.so"))
    tampered = tmp_path / "tampered"
    tampered.write_bytes(b"not the build that was recorded")
    os.replace(tampered, library)  # a new file: the loaded library's mapping stays intact
    monkeypatch.setattr(native, "_state", {})
    assert native.kernel() is not None
    assert native._verified(library) and library.stat().st_size > 1000


@needs_kernel
@pytest.mark.parametrize("mode", [0o777, 0o775])
def test_a_cache_directory_others_may_write_is_never_used(monkeypatch, tmp_path, mode):
    shared, fallback = tmp_path / "shared", tmp_path / "tmp"
    shared.mkdir(mode=0o700)
    fallback.mkdir(mode=0o700)
    shared.chmod(mode)
    monkeypatch.setenv("QCORE_CACHE_DIR", str(shared))
    monkeypatch.setattr(native.tempfile, "gettempdir", lambda: str(fallback))
    monkeypatch.setattr(native, "_state", {})
    assert native.kernel() is not None
    assert not list(shared.iterdir()) and list(fallback.glob("qcore-*/_kernels-*.so"))


@needs_kernel
@pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() != 0, reason="chown to another user needs root")
def test_a_cache_directory_of_another_user_is_never_used(monkeypatch, tmp_path):
    theirs, temp = tmp_path / "theirs", tmp_path / "tmp"
    squatted = temp / f"qcore-{os.getuid()}"  # the per-user temp folder, made first by someone else
    for folder in (theirs, squatted):
        folder.mkdir(mode=0o700, parents=True)
        os.chown(folder, 4321, 4321)
    monkeypatch.setenv("QCORE_CACHE_DIR", str(theirs))
    monkeypatch.setattr(native.tempfile, "gettempdir", lambda: str(temp))
    monkeypatch.setattr(native, "_state", {})
    assert native.kernel() is None and "private cache directory" in native.status()


def test_a_platform_without_getuid_takes_the_torch_path(monkeypatch, tmp_path):
    monkeypatch.setenv("QCORE_CACHE_DIR", str(tmp_path))
    monkeypatch.delattr(os, "getuid")
    monkeypatch.setattr(native, "_state", {})
    assert native.kernel() is None and "getuid" in native.status()
    observer = _observe([torch.randn(16, 4)] * 2, ch_axis=-1, percentiles=(0.975,))
    assert observer.num_batches_tracked == 2


@needs_kernel
def test_the_kernel_refuses_buffers_too_small_for_its_arguments():
    import ctypes

    library, x = native.kernel(), torch.randn(32, 8)
    state = [torch.zeros(2), torch.zeros(2, dtype=torch.float64), torch.full((8,), float("inf")),
             torch.full((8,), float("-inf")), torch.zeros(8)]
    ratio_sums, ratio_counts = torch.zeros(1, 8, dtype=torch.float64), torch.zeros(1, 8)
    picks, no_sample = torch.tensor([0], dtype=torch.int64), torch.empty(0, dtype=torch.int64)
    needed = library.qcore_scratch_floats(32, 8, 1, 2, 0, 1)

    def observe(scratch_floats, k=2, state_channels=8, ratio_slots=8, pick=0):
        picks[0] = pick
        scratch = torch.empty(max(scratch_floats, needed))
        return library.qcore_observe(x.data_ptr(), 32, 8, 1, k, picks.data_ptr(), 1, no_sample.data_ptr(), 0,
                                     scratch.data_ptr(), scratch_floats, 1, *(t.data_ptr() for t in state),
                                     state_channels, ratio_sums.data_ptr(), ratio_counts.data_ptr(), ratio_slots)

    assert observe(needed) == 0
    refused = [observe(needed - 1), observe(needed, k=129), observe(needed, state_channels=4),
               observe(needed, ratio_slots=7), observe(needed, pick=2), observe(needed, pick=-1)]
    assert refused == [native.REFUSED] * len(refused)
    assert isinstance(ctypes.c_int64(0).value, int)


@pytest.mark.skipif(__import__("shutil").which("cc") is None, reason="no C compiler")
def test_the_kernel_source_compiles_without_warnings(tmp_path):
    import subprocess

    flags = ["-std=c99", "-fopenmp", "-Wall", "-Wextra", "-Wshadow", "-Werror", "-fsyntax-only"]
    done = subprocess.run(["cc", *flags, *map(str, native._SOURCES)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


@settings(max_examples=60, deadline=None)
@given(activations(), activations(), st.booleans(), st.booleans())
def test_observers_on_rows_of_one_range_allocation_observe_as_observers_made_alone(first, second, kernel, queued):
    """A detector makes its observers' starting ranges together (fresh_ranges: rows of one allocation): each ends
    in the state an observer made alone ends in, on the native and torch paths and through the queue of a model
    call, whatever the others observe."""
    import contextlib
    from unittest import mock

    from qcore.report.observer import fresh_ranges
    from qcore.runtime import deferred

    cases = [first, second]
    with mock.patch.object(native, "kernel", native.kernel if kernel else lambda: None):
        pooled = [ReportObserver(**settings_, ranges=ranges) for (_, settings_), ranges in zip(cases, fresh_ranges(2))]
        alone = [ReportObserver(**settings_) for _, settings_ in cases]
        for observers in (pooled, alone):
            with deferred.batched_updates() if queued else contextlib.nullcontext():
                for index in range(max(len(batches) for batches, _ in cases)):
                    for observer, (batches, _) in zip(observers, cases):
                        if index < len(batches):
                            observer(batches[index])
    for ours, reference in zip(pooled, alone):
        _assert_same_state(ours, reference)
    assert pooled[0].extremes.data_ptr() != pooled[1].extremes.data_ptr()


def test_observers_of_one_shape_share_one_sample_index_and_free_it_together(monkeypatch):
    """An LLM's layer inputs have one shape: their observers hold one [channels, m] index between them, not one
    each, with the same positions each would make, and it goes with the last of them."""
    from qcore.report import observer as report_observer

    _torch_path(monkeypatch)
    batches = [torch.randn(2, 64, 96, dtype=torch.bfloat16) for _ in range(2)]
    first, second = (_observe(batches, ch_axis=1, percentiles=(0.975,), sample_size=128) for _ in range(2))
    index = first._sample_positions(batches[0].shape, 1, batches[0].device)
    assert second._sample_positions(batches[0].shape, 1, batches[0].device) is index
    channel = torch.arange(64) * 96
    offsets = report_observer.channel_sample_offsets((2, 64, 96), 1, 128, 0)
    assert torch.equal(index, channel[:, None] + offsets[None, :])
    key = ((2, 64, 96), 1, 128, 0, torch.device("cpu"))
    assert report_observer._SHARED_INDICES.get(key) is index
    del first, second, index
    assert report_observer._SHARED_INDICES.get(key) is None
