"""Several artifacts of one reference measured in one pass (measure_artifacts, ArtifactGroup): the reference runs
once per batch for all of them, and each artifact's numbers are the ones it gets alone, whole or block by block."""
import pytest
import torch
from torchao.quantization import Int8DynamicActivationInt8WeightConfig, Int8WeightOnlyConfig

from qcore.artifact import ArtifactAnalysis, ArtifactError, ArtifactGroup, artifact_layers
from qcore.artifact.blockwise import measure_artifacts_blockwise
from qcore.artifact.measure import ArtifactRun, measure_artifact, measure_artifacts
from tests.helpers import float_and_w4a16_checkpoints, token_batches, torchao_artifact
from tests.qcore.test_artifact_blockwise import _same, _whole


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """A 4-layer tiny Llama, its W4A16 compressed-tensors checkpoint and two torchao artifacts of it."""
    checkpoints = float_and_w4a16_checkpoints(tmp_path_factory.mktemp("checkpoints"))
    reference = _whole(checkpoints / "float")
    return reference, {"w4a16": _whole(checkpoints / "w4a16"),
                       "w8a8": torchao_artifact(reference, Int8DynamicActivationInt8WeightConfig()),
                       "w8a16": torchao_artifact(reference, Int8WeightOnlyConfig())}


class _Calls:
    """Counts the forward calls of a module."""

    def __init__(self, module):
        self.count = 0
        self.handle = module.register_forward_pre_hook(self._seen)

    def _seen(self, module, args):
        self.count += 1


def _runs(reference, artifacts):
    runs = []
    for number, quantized in enumerate(artifacts.values()):
        layers = artifact_layers(reference, quantized)
        swapped = (layers[2].name,) if number == 1 else ()  # one run with a float layer of its own
        runs.append(ArtifactRun(quantized, tuple(layers), swapped, None, True))
    return runs


def test_one_reference_pass_gives_each_artifact_its_own_numbers(models):
    reference, artifacts = models
    batches = token_batches(3)
    runs = _runs(reference, artifacts)
    calls = _Calls(reference)
    together = measure_artifacts(reference, runs, batches)
    calls.handle.remove()
    assert calls.count == len(batches)  # not once per artifact
    for run, measured in zip(runs, together):
        alone = measure_artifact(reference, run.quantized, run.layers, batches, float_layers=run.float_layers,
                                 logits=True)
        _same(alone, measured)
    assert together[0].sqnr.layers != together[1].sqnr.layers  # three artifacts, three sets of numbers


def test_block_by_block_each_reference_block_runs_once_per_batch(models):
    reference, artifacts = models
    batches = token_batches(2)
    runs = _runs(reference, artifacts)
    calls = _Calls(reference.model.layers[1])
    together = measure_artifacts_blockwise(reference, runs, batches, "model.layers")
    calls.handle.remove()
    assert calls.count == len(batches)
    for run, measured in zip(runs, together):
        _same(measure_artifact(reference, run.quantized, run.layers, batches, float_layers=run.float_layers,
                               logits=True), measured)


def test_a_group_measures_its_members_together_and_each_reads_its_own(models):
    reference, artifacts = models
    batches = token_batches(2)
    group = ArtifactGroup()
    members = {key: ArtifactAnalysis(reference, quantized, group=group, member=key).planned(logits=True)
               for key, quantized in artifacts.items()}
    assert list(group.members.values()) == list(members.values())  # planned analyses took their keys' places
    first = members["w4a16"]
    first.attach_batches(batches)
    calls = _Calls(reference)
    measured = first.measurement
    assert calls.count == len(batches)
    for key, member in members.items():
        assert "measurement" in member.__dict__, key  # measured in the first member's pass
        alone = ArtifactAnalysis(reference, artifacts[key], batches, logits=True)
        _same(alone.measurement, member.measurement)
    assert measured is first.measurement
    calls.handle.remove()


def test_an_artifact_that_raises_errors_alone(models):
    reference, artifacts = models
    batches = token_batches(2)
    broken = torchao_artifact(reference, Int8WeightOnlyConfig())
    layer = artifact_layers(reference, broken)[3].name

    def raises(*args, **kwargs):
        raise RuntimeError("no kernel for this format here")

    broken.get_submodule(layer).forward = raises
    group = ArtifactGroup()
    good = ArtifactAnalysis(reference, artifacts["w8a8"], batches, group=group, member="good")
    bad = ArtifactAnalysis(reference, broken, group=group, member="bad")
    assert good.measurement.sqnr.layers  # the good artifact is measured, alone once the shared pass failed
    with pytest.raises(ArtifactError, match=f"in layer {layer}: no kernel for this format here"):
        bad.attach_batches(batches)
        bad.measurement  # noqa: B018 - the property measures
    _same(ArtifactAnalysis(reference, artifacts["w8a8"], batches).measurement, good.measurement)
    assert torch.isfinite(torch.tensor([e.sqnr_db for e in good.measurement.sqnr.layers.values()])).all()
