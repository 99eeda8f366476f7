"""The artifact fix search screens, then confirms: candidates are screened on the first batches, the set it returns is
measured on every batch, and a set that only screens well is not taken for one that reaches the target; its trials
are shared by every metric's search and resume from the first changed block without running the reference."""
import copy
import math

import torch
from torch import nn

from qcore.artifact import ArtifactAnalysis
from tests.helpers import tiny_llama

EARLY = "model.layers.0.mlp.down_proj"
LATE = "model.layers.1.mlp.down_proj"


class _Damaged(nn.Linear):
    """A tool's replaced Linear that computes with a damaged weight: a deterministic error on every position from
    `start` on."""

    start, scale = 0, 0.5

    def forward(self, x):
        out = super().forward(x)
        error = self.scale * out.abs().mean() * torch.sin(out * 997.0)
        keep = torch.arange(out.shape[-2], device=out.device) < self.start
        return torch.where(keep[:, None], out, out + error)


class _DamagedLate(_Damaged):
    start, scale = 16, 5.0  # only sequences longer than 16 tokens see it


def _artifact(reference, damaged):
    model = copy.deepcopy(reference)
    for name, kind in damaged.items():
        model.get_submodule(name).__class__ = kind
    return model


def _batches(lengths):
    generator = torch.Generator().manual_seed(1)
    return [{"input_ids": torch.randint(0, 128, (2, length), generator=generator)} for length in lengths]


def _output_db(reference, artifact, batches, float_layers):
    analysis = ArtifactAnalysis(reference, artifact, batches, float_layers=float_layers)
    return analysis.measurement.sqnr.worst_output().sqnr_db


def test_a_set_that_screens_well_and_falls_short_on_every_batch_is_not_taken_for_a_fix():
    reference = tiny_llama()
    artifact = _artifact(reference, {EARLY: _Damaged, LATE: _DamagedLate})
    batches = _batches([16, 16, 32, 32])  # the screen's two batches are short: the late damage does not show there
    analysis = ArtifactAnalysis(reference, artifact, batches)
    assert math.isinf(_output_db(reference, artifact, batches[:2], [EARLY]))  # keeping EARLY screens perfect
    fix = analysis.float_layers_fix(30.0, max_batches=2)
    assert fix.float_layers == (EARLY,)  # the best the screen found (a proper subset: never both layers)
    assert not fix.reached and fix.measured < 30.0
    assert fix.measured == _output_db(reference, artifact, batches, [EARLY])  # measured on every batch


def test_every_returned_set_is_measured_on_every_batch_however_close_the_screen_is():
    reference = tiny_llama()
    artifact = _artifact(reference, {EARLY: _Damaged, LATE: _Damaged})
    batches = _batches([16, 16, 16, 16])
    analysis = ArtifactAnalysis(reference, artifact, batches)
    screened = _output_db(reference, artifact, batches[:2], [LATE])
    # the target just under the screen's value of the set: the screen meets it by a hair, every batch decides
    target = screened - 1e-6
    fix = analysis.float_layers_fix(target, max_batches=2)
    assert fix.measured == _output_db(reference, artifact, batches, list(fix.float_layers))
    assert fix.reached == (fix.measured >= target)
    assert len(fix.float_layers) == 1


def test_one_search_serves_every_gate_and_trials_run_no_reference_pass():
    reference = tiny_llama(layers=4)
    damaged = {f"model.layers.{index}.mlp.down_proj": _Damaged for index in range(4)}
    artifact = _artifact(reference, damaged)
    batches = _batches([16, 16, 16])
    analysis = ArtifactAnalysis(reference, artifact, batches, logits=True)
    analysis.measurement  # noqa: B018 - the analysis's own pass
    calls = []
    handle = reference.model.layers[0].register_forward_pre_hook(lambda module, args: calls.append(1))
    first = analysis.float_layers_fix(analysis.measurement.sqnr.worst_output().sqnr_db + 6, max_batches=2)
    handle.remove()
    assert first.reached and 1 <= len(first.float_layers) < 4
    # the reference ran for the screen's recording pass (2 batches) and each confirmation (3 batches), never per trial
    assert len(calls) <= 2 + 3 * 2 and first.trials > 4
    # KL's search finds the set model_sqnr's confirmed meets its target: nothing runs
    kept = dict(analysis._trials)
    kl_with_fix = analysis._value("kl_nats", first.float_layers, analysis.batches)
    assert analysis._trials == kept  # the confirmed set's trial holds the logits too
    second = analysis.float_layers_fix(kl_with_fix * 1.01, metric="kl_nats", max_batches=2)
    assert second.float_layers == first.float_layers and second.reached and second.trials == 1
    assert analysis._trials == kept


def test_the_analysis_pass_keeps_the_screens_stream_and_no_more(monkeypatch):
    import qcore.artifact.measure as measure

    reference = tiny_llama(layers=4)
    artifact = _artifact(reference, {f"model.layers.{index}.mlp.down_proj": _Damaged for index in range(4)})
    batches = _batches([16] * 5)
    layer = "model.layers.2.mlp.down_proj"
    kept = ArtifactAnalysis(reference, artifact, batches)
    kept.measurement  # noqa: B018 - the analysis's pass, which keeps the stream of the screen's batches
    screen = kept._first_batches(kept.batches, 2)
    [(recorded, record)] = kept._records.values()
    assert recorded is screen and [len(entries) for entries in record.inputs] == [2] * 4  # not one per batch
    calls = []
    handle = reference.model.layers[0].register_forward_pre_hook(lambda module, args: calls.append(1))
    resumed = kept._value("output_sqnr_db", [layer], screen, resume=True)
    handle.remove()
    assert calls == []  # no reference pass: its outputs were recorded with the stream
    assert resumed == _output_db(reference, artifact, batches[:2], [layer])
    # past the limit nothing is kept, and the screen records its own stream, to the same value
    monkeypatch.setattr(measure, "RECORD_LIMIT_BYTES", 1024)
    dropped = ArtifactAnalysis(reference, artifact, batches)
    dropped.measurement  # noqa: B018
    assert not dropped._records
    assert dropped._value("output_sqnr_db", [layer], dropped._first_batches(dropped.batches, 2), resume=True) == \
        resumed


def test_a_target_no_candidate_set_meets_on_the_screen_costs_one_screen_and_one_confirmation():
    reference = tiny_llama(layers=4)
    artifact = _artifact(reference, {f"model.layers.{index}.mlp.down_proj": _Damaged for index in range(4)})
    batches = _batches([16, 16, 16])
    analysis = ArtifactAnalysis(reference, artifact, batches)
    analysis.measurement  # noqa: B018
    fix = analysis.float_layers_fix(80.0, max_batches=2, max_candidates=2)
    # both candidates in float at once fall short on the screen: no candidate is tried alone
    assert len(analysis._trials) == 2  # that screen, and the set measured on every batch
    assert len(fix.float_layers) == 2 and not fix.reached
    assert fix.measured == _output_db(reference, artifact, batches, list(fix.float_layers))


class _Halving(nn.Module):
    """A model that scales its stream between its blocks: a trial cannot resume from a block's recorded input."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(128, 32)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(32, 32), nn.Tanh()) for _ in range(3))
        self.head = nn.Linear(32, 128)

    def forward(self, input_ids):
        stream = self.embed(input_ids)
        for block in self.blocks:
            stream = block(stream) * 0.5
        return self.head(stream)


def test_a_model_that_computes_between_its_blocks_keeps_no_stream_and_its_trials_are_whole_passes():
    reference = _Halving().eval()
    artifact = _artifact(reference, {"blocks.0.0": _Damaged, "blocks.2.0": _Damaged})
    batches = _batches([8, 8, 8])
    analysis = ArtifactAnalysis(reference, artifact, batches)
    analysis.measurement  # noqa: B018
    assert not analysis._records
    screen = analysis._first_batches(analysis.batches, 2)
    assert analysis._value("output_sqnr_db", ["blocks.2.0"], screen, resume=True) == \
        _output_db(reference, artifact, batches[:2], ["blocks.2.0"])
