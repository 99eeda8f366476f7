"""On a GPU (skipped without one): the analysis runs there, copies nothing to the host per batch, and measures what
it measures on the CPU. Every host read is seen twice: as a device-to-host copy in torch's profiler, and as a
synchronizing call under torch.cuda's sync debug mode."""
import warnings

import pytest
import torch
from torch import nn

import qcore
from pytest_qreport.checks import BUILTIN_CHECKS
from pytest_qreport.core.pipeline import ModelPipeline, collect_model
from pytest_qreport.core.registry import CheckRegistry
from pytest_qreport.core.settings import ModelSettings
from qcore.analysis import calibration_digest
from qcore.measure.passes import measure_model
from qcore.report import DynamicStaticDetector, InputWeightEqualizationDetector, OutlierDetector, PerChannelDetector

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 16, 3, padding=1)
        self.fc1, self.norm, self.fc2, self.head = nn.Linear(16, 64), nn.LayerNorm(64), nn.Linear(64, 64), \
            nn.Linear(64, 10)

    def forward(self, x):
        x = torch.relu(self.conv(x)).mean(dim=(2, 3))
        return self.head(torch.relu(self.fc2(self.norm(torch.relu(self.fc1(x))))))


def _model_and_batches(batch_count: int, device: str) -> tuple[nn.Module, list[torch.Tensor]]:
    torch.manual_seed(0)
    model = _Net().eval().to(device)
    g = torch.Generator().manual_seed(1)
    distinct = [torch.randn(16, 3, 8, 8, generator=g) for _ in range(3)]
    for x in distinct:
        x[3, 1] *= 20.0  # an outlier channel, so that the outlier screen names layers
    # 3 batches, repeated: 9 batches give the same statistics, findings and trials, so only per-batch work differs
    return model, [distinct[i % 3].clone().to(device) for i in range(batch_count)]


class HostTraffic:
    """Device-to-host copies (profiler) and synchronizing calls (sync debug mode) inside the block."""

    copies_to_host = copies_to_device = syncs = 0

    def __enter__(self) -> "HostTraffic":
        torch.cuda.synchronize()
        self._warnings = warnings.catch_warnings(record=True)
        self.caught = self._warnings.__enter__()
        warnings.simplefilter("always")
        self._profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                            torch.profiler.ProfilerActivity.CUDA])
        self._profiler.__enter__()
        torch.cuda.set_sync_debug_mode("warn")
        return self

    def __exit__(self, *exc) -> None:
        torch.cuda.set_sync_debug_mode("default")
        torch.cuda.synchronize()
        self._profiler.__exit__(*exc)
        self._warnings.__exit__(*exc)
        names = [event.name for event in self._profiler.events()]
        self.copies_to_host = sum(1 for name in names if "DtoH" in name or "Device -> Pageable" in name)
        self.copies_to_device = sum(1 for name in names if "HtoD" in name)
        self.syncs = sum(1 for w in self.caught if "synchroniz" in str(w.message))

    def counts(self) -> dict[str, int]:
        """What was seen, as a dict (for messages)."""
        return {"copies_to_host": self.copies_to_host, "copies_to_device": self.copies_to_device,
                "syncs": self.syncs}


def _assert_not_per_batch(fewer: HostTraffic, more: HostTraffic, extra_batches: int) -> None:
    """`more` (the same analysis on `extra_batches` more batches) read the host less than once per extra batch: the
    counts may differ by a one-time call (seen: one synchronizing call more or less between two runs), not more."""
    assert more.copies_to_host - fewer.copies_to_host < extra_batches, (fewer.counts(), more.counts())
    assert more.syncs - fewer.syncs < extra_batches, (fewer.counts(), more.counts())


def _measured_traffic(batch_count: int) -> HostTraffic:
    model, batches = _model_and_batches(batch_count, "cuda")
    float_gm = qcore.capture(model, batches[0])
    detectors = {"per_channel": PerChannelDetector(), "dynamic_static": DynamicStaticDetector(),
                 "input_weight": InputWeightEqualizationDetector(0.5), "outlier": OutlierDetector()}
    with HostTraffic() as traffic:
        measured = measure_model(float_gm, batches, qcore.Int8StaticQuantizer(), detectors=detectors,
                                 equalization_layers=["fc1", "fc2", "head"], smoothing="search", logits=True)
    assert measured.sqnr.outputs and measured.variants
    return traffic


def test_a_measurement_on_cuda_copies_nothing_to_the_host_per_batch():
    # calibration (quantizer, detector and variant observers) and the comparison pass (propagated, shadow, variant
    # comparators, logits): what is read back is read per measurement, so 9 batches read no more than 3 (on an
    # H200: the same counts, give or take one one-time synchronizing call)
    _measured_traffic(3)  # a process's first measurement makes one more synchronizing call (a one-time set-up)
    three, nine = _measured_traffic(3), _measured_traffic(9)
    # the results are read back at the end: a profiler or debug mode that saw nothing would prove nothing
    assert three.copies_to_host > 0 and three.syncs > 0, three.counts()
    _assert_not_per_batch(three, nine, extra_batches=6)


def collected(model: nn.Module, batches: list, checks: list[str], **settings) -> ModelPipeline:
    """The plugin's pipeline of `model` with `checks` (and `settings`), captured, not yet analysed."""
    registry = CheckRegistry()
    for check in BUILTIN_CHECKS:
        registry.register(check)
    resolved = ModelSettings.defaults(BUILTIN_CHECKS, checks=checks, calibration=batches, **settings)
    return collect_model("model", resolved, registry, qcore.Int8StaticQuantizer(), model, batches[0])


def _analysis_traffic(batch_count: int, checks: list[str]) -> HostTraffic:
    model, batches = _model_and_batches(batch_count, "cuda")
    pipeline = collected(model, batches, checks)
    with HostTraffic() as traffic:
        pipeline.analyze(lambda: batches, lambda found: None)
    assert not pipeline.failed, pipeline.error
    return traffic


def test_the_plugins_analysis_on_cuda_copies_nothing_to_the_host_per_batch():
    # every built-in check, sensitivity trials and verified advice included
    checks = [check.name for check in BUILTIN_CHECKS]
    _analysis_traffic(3, checks)  # the process's one-time set-ups out of the way
    three, nine = _analysis_traffic(3, checks), _analysis_traffic(9, checks)
    assert three.copies_to_host > 0 and three.syncs > 0, three.counts()
    _assert_not_per_batch(three, nine, extra_batches=6)


def test_cuda_and_cpu_measure_the_same_layers_alike():
    results = {}
    for device in ("cpu", "cuda"):
        model, batches = _model_and_batches(4, device)
        float_gm = qcore.capture(model, batches[0])
        results[device] = measure_model(float_gm, batches, qcore.Int8StaticQuantizer())
    cpu, cuda = results["cpu"].sqnr, results["cuda"].sqnr
    assert set(cpu.layers) == set(cuda.layers) and cpu.layers
    for layer, value in cpu.layers.items():
        assert abs(cuda.layers[layer].shadow_sqnr_db - value.shadow_sqnr_db) < 1.0, (layer, value, cuda.layers[layer])
    for name, value in cpu.outputs.items():
        assert abs(cuda.outputs[name].sqnr_db - value.sqnr_db) < 1.0, (name, value, cuda.outputs[name])


def test_a_model_declared_on_a_device_runs_its_analysis_there():
    model, batches = _model_and_batches(2, "cpu")
    pipeline = collected(model, batches, ["sqnr", "model_sqnr"], device="cuda")
    pipeline.analyze(lambda: batches, lambda found: None)  # CPU batches: moved to the model's device one at a time
    assert not pipeline.failed, pipeline.error
    assert next(model.parameters()).device.type == "cuda"
    assert pipeline.facts().fingerprint["device"] == "cuda"


def test_the_calibration_digest_is_the_same_on_cuda_as_on_the_cpu():
    _, batches = _model_and_batches(3, "cpu")
    batches = [{"image": x, "ids": torch.arange(5)} for x in batches]
    on_cuda = [{name: value.to("cuda") for name, value in batch.items()} for batch in batches]
    assert calibration_digest(on_cuda) == calibration_digest(batches)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_fake_quantization_on_cuda_is_the_float32_one_rounded_back(dtype):
    """The CUDA kernel takes fp16/bf16 in their own dtype: what float32 gives, rounded back (the CPU test's claim)."""
    from qcore.observe import qparams

    x = torch.randn(4096, generator=torch.Generator().manual_seed(0)) * 40
    x[:5] = torch.tensor([float("nan"), -0.0, -1e-4, float("inf"), -float("inf")])
    x = x.to(dtype).cuda()
    wide = x.float()
    for scale, zero_point in ((0.05, 0), (0.013, 17)):
        ours = qparams.fake_quantize_per_tensor(x, scale, zero_point, -128, 127)
        expected = torch.fake_quantize_per_tensor_affine(wide, qparams._float32(scale), zero_point, -128, 127)
        expected = torch.where(wide.isnan(), wide, expected).to(dtype)
        assert torch.equal(ours.isnan(), expected.isnan())
        assert torch.equal(torch.nan_to_num(ours), torch.nan_to_num(expected))
        numbers = ~x.isnan()  # a NaN's sign is no value: the cast to fp16/bf16 makes its own NaN, ours keeps x's
        assert torch.equal(ours[numbers].signbit(), expected[numbers].signbit())
        assert torch.equal(ours[~numbers].view(torch.int16), x[~numbers].view(torch.int16))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_the_fused_per_channel_kernel_on_cuda_gives_the_torch_paths_values(dtype):
    """What convert takes it for (finite weights, zero points 0): the torch path's values, sign of zero included."""
    from qcore.observe import qparams

    x = (torch.randn(16, 300, generator=torch.Generator().manual_seed(0)) * 0.05).to(dtype)
    x[0, :3] = torch.tensor([0.0, -0.0, -1e-30]).to(dtype)
    x = x.cuda()
    scale = torch.clamp(x.float().abs().amax(dim=1) / 127.5, min=torch.finfo(torch.float32).eps)
    zero_point = torch.zeros(16, dtype=torch.int64, device="cuda")
    expected = qparams.fake_quantize_per_channel(x, scale, zero_point, 0, -128, 127)
    ours = qparams.fake_quantize_finite_per_channel(x, scale, zero_point.int(), 0, -128, 127)
    assert torch.equal(ours, expected) and torch.equal(ours.signbit(), expected.signbit())


MOE_CHECKS = ["sqnr", "weight_sqnr", "expert_coverage", "routing_agreement", "model_sqnr"]


def _moe_findings(device: str) -> dict:
    """The MoE items of a seeded 2-block Qwen3-MoE (8 experts, top-2) analysed on `device` under int8 static."""
    from tests.models import tiny_moe

    model, batches = tiny_moe("qwen3_moe", layers=2, experts=8, batch=4, n=4)
    pipeline = collected(model, batches, MOE_CHECKS, device=device)
    pipeline.analyze(lambda: batches, lambda found: None)
    assert not pipeline.failed, pipeline.error
    return pipeline.findings


def test_an_moe_models_expert_items_on_cuda_are_the_cpus():
    """The fused experts are captured, quantized per expert and measured on the GPU as on the CPU: the same items,
    every expert's weight SQNR to 0.01 dB, its activation SQNR and the model's to 1 dB (the dense test's bound), the
    tokens each expert received and the router's agreement to a token or two (a tie broken otherwise on the GPU)."""
    pytest.importorskip("transformers")
    cpu, cuda = _moe_findings("cpu"), _moe_findings("cuda")
    assert set(cpu) == set(cuda)
    projections = [key for key in cpu if key[0] in ("sqnr", "weight_sqnr") and ".mlp.experts." in key[1]]
    assert len(projections) == 2 * 2 * 2, sorted(cpu)  # sqnr and weight_sqnr, 2 blocks, gate_up_proj and down_proj
    for key, found in cpu.items():
        assert found.verdict != "error" and cuda[key].verdict != "error", (found, cuda[key])
    for check, layer in projections:
        ours, theirs = cuda[check, layer].details["experts"], cpu[check, layer].details["experts"]
        assert set(ours) == set(theirs) and len(ours) == 8 * (2 if layer.endswith("gate_up_proj") else 1)
        bound = 0.01 if check == "weight_sqnr" else 1.0
        for expert, value in theirs.items():
            assert abs(ours[expert] - value) < bound, (check, layer, expert, ours[expert], value)
    for key in [key for key in cpu if key[0] == "expert_coverage"]:
        ours, theirs = cuda[key].details["tokens"], cpu[key].details["tokens"]
        assert sum(ours) == sum(theirs) and max(abs(a - b) for a, b in zip(ours, theirs)) <= 2, (key, ours, theirs)
    for key in [key for key in cpu if key[0] in ("routing_agreement", "model_sqnr")]:
        assert abs(cuda[key].value - cpu[key].value) < (0.02 if key[0] == "routing_agreement" else 1.0), key


def test_fused_experts_captured_on_cuda_compute_what_transformers_grouped_mm_does():
    """On the GPU transformers' default experts implementation runs torch's grouped matrix product, not the CPU's
    fallback: the captured graph, whose experts are one Linear each, computes the same logits."""
    pytest.importorskip("transformers")
    from tests.models import logits_of, tiny_moe

    model, batches = tiny_moe("qwen3_moe", layers=2, experts=8, batch=4, n=2)
    model.cuda()
    batches = [{name: value.cuda() for name, value in batch.items()} for batch in batches]
    with torch.no_grad():
        eager = model(**batches[1]).logits
        graph = qcore.capture(model, batches[0])
        torch.testing.assert_close(logits_of(graph(**batches[1])), eager, atol=1e-4, rtol=1e-3)
