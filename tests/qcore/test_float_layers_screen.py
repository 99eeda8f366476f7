"""The float_layers search of simulation mode screens, then confirms: its candidates are the layers with the largest
own error (no layer is estimated for the pool), each screened alone through the switches on the search batches, the
shortest head of them found by bisection there, and every set it returns measured exactly, re-quantized with it in
float, on every batch; a set that only screens well is never returned as reaching the target. When the candidates
fall short, the screen widens to the first layers in graph order, whose single runs the sensitivity ranking shares."""
import math

import torch
from hypothesis import given
from hypothesis import strategies as st

import qcore
from qcore.analysis import ModelAnalysis, measure_sqnr, with_float_layers
from qcore.measure.screens import screened_ladder, shortest_head
from qcore.search import sensitivity
from tests.qcore.test_resume import tiny_llama


@given(st.lists(st.floats(0, 60), min_size=1, max_size=10), st.floats(0, 60), st.floats(-5, 5))
def test_the_shortest_head_is_confirmed_and_a_head_that_only_screens_well_is_not_taken(gains, target, drift):
    # the metric of a head: the sum of its gains (more in float is never worse); every batch differs by `drift`
    ladder = [f"layer{index}" for index in range(len(gains))]
    value = dict(zip(ladder, gains))
    screens, confirms = [], []

    def screen(head):
        screens.append(head)
        return sum(value[name] for name in head) >= target

    def confirm(head):
        confirms.append(head)
        return sum(value[name] for name in head) + drift >= target

    head, screened, confirmed, stopped = shortest_head(ladder, screen, confirm)
    assert not stopped  # no fix budget is tracked here
    assert (screened, confirmed) == (len(screens), len(confirms)) and head in confirms  # returned means confirmed
    assert screened <= 1 + math.ceil(math.log2(len(ladder))) and confirmed <= 2
    meets = [k for k in range(1, len(ladder) + 1) if sum(gains[:k]) >= target]
    if meets and sum(gains[:meets[0]]) + drift >= target:
        assert len(head) == meets[0]  # the shortest head the screen meets, confirmed on every batch
    else:  # none meets the screen, or the one that does falls short on every batch: the whole ladder, measured
        assert head == ladder


def test_a_bisection_the_fix_budget_stops_confirms_the_shortest_head_that_met_the_screen():
    from qcore.runtime.progress import StageTimes, graph_run, stage, tracked

    ladder = [f"layer{index}" for index in range(8)]
    screens, confirms = [], []

    def screen(head):  # every screen spends the whole budget: 1 graph run of the verdict pass's 1
        screens.append(head)
        with stage("trials"):
            graph_run()
        return len(head) >= 3

    def confirm(head):
        confirms.append(head)
        return len(head) >= 3

    with tracked(times=StageTimes(fix_budget=1.0)):
        with stage("comparison"):
            graph_run()
        found = shortest_head(ladder, screen, confirm)
        assert found.stopped and screens == [ladder] and confirms == [ladder] and found.head == ladder
        assert shortest_head(ladder, screen, confirm) == (ladder, 0, 1, True)  # spent before its first screen
    assert len(screens) == 1  # the second search screened nothing, and confirmed what it returns


def test_a_head_that_falls_short_is_returned_as_measured_when_the_budget_does_not_hold_the_whole_ladder():
    from qcore.runtime.progress import StageTimes, graph_run, stage, tracked, trial_step

    ladder = [f"layer{index}" for index in range(8)]
    confirms = []

    def screen(head):  # a screen: one graph run
        with stage("trials"):
            graph_run()
        return len(head) >= 3

    def confirm(head):  # a whole-model trial: five; the screen's head falls short on every batch
        confirms.append(head)
        with stage("trials"), trial_step():
            graph_run(5)
        return len(head) >= 5

    with tracked(times=StageTimes(fix_budget=1.0)) as times:
        with stage("calibration"):
            graph_run()
        with stage("comparison"):
            graph_run(9)
        found = shortest_head(ladder, screen, confirm)
    # the head was confirmed, and fell short; the whole ladder's confirmation would overrun the 10 runs allowed
    assert confirms == [ladder[:3]] and found.head == ladder[:3] and found.stopped
    assert times.runs["trials"] <= 10


def test_the_ladder_tries_the_layers_that_help_alone_first_and_drops_none():
    pool = ["a", "b", "c", "d"]
    assert screened_ladder(pool, {"a": 10.0, "b": 14.0, "c": 9.0, "d": math.nan}, base=10.0) == ["b", "a", "c", "d"]
    assert screened_ladder(pool, {"a": 0.5, "b": 0.2, "c": 0.9}, base=0.6, higher=False) == ["b", "a", "c", "d"]


def _llama():
    model, batches = tiny_llama(layers=2, batch=2)
    float_gm = qcore.capture(model, batches[0])
    return float_gm, batches


def _exact_db(float_gm, batches, layers):
    return measure_sqnr(float_gm, batches, with_float_layers(qcore.Int8StaticQuantizer(), layers),
                        shadow=False).worst_output().sqnr_db


def test_the_search_screens_its_candidates_only_and_measures_the_set_it_returns_on_every_batch(monkeypatch):
    float_gm, batches = _llama()
    analysis = ModelAnalysis(float_gm, batches=batches)
    target = _exact_db(float_gm, batches, analysis.fix_candidates(4)[:1]) - 0.05  # within the screen's reach
    runs = []
    original = sensitivity.FloatReference.batch_sums
    monkeypatch.setattr(sensitivity.FloatReference, "batch_sums",
                        lambda self, gm, batch, run=None: runs.append(1) or original(self, gm, batch, run))
    fix = analysis.float_layers_fix(target, max_batches=2, candidates=4)
    layers = len(analysis.switchable.layers)
    assert layers > 12
    # the all-quantized recording, the 4 candidates at once, each alone, and a bisection of at most 2: per search
    # batch; never one run per layer
    assert len(runs) <= 2 * (1 + 1 + 4 + 2) < 2 * layers
    assert fix.reached and set(fix.float_layers) <= set(analysis.fix_candidates(4)[:4])
    assert fix.measured_db == _exact_db(float_gm, batches, list(fix.float_layers)) >= target


def test_the_switches_and_the_exact_measurements_take_the_analysis_calibration(monkeypatch):
    # keeping layers in float changes no activation observer's values (calibration runs the float graph): the
    # quantizer switches and every set measured exactly take the states the analysis's pass calibrated
    import qcore.quantization.calibrated as calibrated

    float_gm, batches = _llama()
    analysis = ModelAnalysis(float_gm, batches=batches)
    target = analysis.sqnr.worst_output().sqnr_db + 6.0  # beyond the candidates: several sets measured exactly
    passes = []
    monkeypatch.setattr(calibrated, "calibrate", lambda model, batches: passes.append(len(batches)))
    exact = []
    measured = sensitivity.measured_output_sqnr
    monkeypatch.setattr(sensitivity, "measured_output_sqnr", lambda *args: exact.append(args) or measured(*args))
    fix = analysis.float_layers_fix(target, max_batches=2, candidates=4, early_layers=6)
    assert exact and passes == []
    monkeypatch.undo()
    assert fix.measured_db == _exact_db(float_gm, batches, list(fix.float_layers))


def test_a_screen_that_falls_short_widens_to_the_early_layers_and_the_better_measured_set_wins(monkeypatch):
    float_gm, batches = _llama()
    analysis = ModelAnalysis(float_gm, batches=batches)
    target = analysis.sqnr.worst_output().sqnr_db + 6.0  # beyond what 4 candidates reach
    screened = sensitivity._screened_float_layers(analysis.switchable, float_gm, batches, batches[:2],
                                                  analysis.quantizer, target, analysis.fix_candidates(4), 8, 4)
    assert not screened.reached
    widened = []
    original = sensitivity._screened_float_layers
    monkeypatch.setattr(sensitivity, "_screened_float_layers",
                        lambda *args, **options: widened.append(list(args[6][:args[8]])) or original(*args, **options))
    runs = []
    batch_sums = sensitivity.FloatReference.batch_sums
    monkeypatch.setattr(sensitivity.FloatReference, "batch_sums",
                        lambda self, gm, batch, run=None: runs.append(1) or batch_sums(self, gm, batch, run))
    fix = analysis.float_layers_fix(target, max_batches=2, candidates=4, early_layers=6)
    layers = analysis.switchable.layers
    first = analysis.fix_candidates(4)[:4]
    # the candidates, then the candidates and the first 6 layers in graph order, each screened alone
    assert widened[0] == first and widened[1] == list(dict.fromkeys([*first, *layers[:6]]))
    # per search batch: the recordings, the candidates at once, a bisection of at most 4 screens; the singles of the
    # widened screen on the first batch only; never one run per layer, as the greedy search's estimates were
    assert len(runs) <= 2 * (2 + 1 + 4) + len(widened[1]) < 2 * len(layers)
    assert fix.measured_db >= screened.measured_db
    assert fix.measured_db == _exact_db(float_gm, batches, list(fix.float_layers))
    assert fix.reached == (fix.measured_db >= target)


def test_the_widened_screen_shares_its_runs_with_the_sensitivity_ranking(monkeypatch):
    float_gm, batches = _llama()
    analysis = ModelAnalysis(float_gm, batches=batches)
    target = analysis.sqnr.worst_output().sqnr_db + 6.0  # beyond what 4 candidates reach: the screen widens
    analysis.float_layers_fix(target, max_batches=2, candidates=4, early_layers=8)
    runs = []
    batch_sums = sensitivity.FloatReference.batch_sums
    monkeypatch.setattr(sensitivity.FloatReference, "batch_sums",
                        lambda self, gm, batch, run=None: runs.append(1) or batch_sums(self, gm, batch, run))
    ranking = analysis.sensitivity(8, 2, 0, 3)
    # each of the 8 layers was screened alone on the same first batch: the ranking records its starting point and
    # measures its 3 best estimates on the second batch only
    assert len(ranking.layers) == 8 and len(runs) == 2 + 3
    assert [entry.batches for entry in ranking.layers] == [2] * 3 + [1] * 5
    runs.clear()
    every = analysis.sensitivity(8, 2, 0)  # every layer on both batches: the 5 others' second batch runs
    assert len(runs) == 2 + 5 and {entry.batches for entry in every.layers} == {2}


def test_a_target_a_hair_under_the_screen_is_decided_on_every_batch():
    float_gm, batches = _llama()
    analysis = ModelAnalysis(float_gm, batches=batches)
    first = analysis.fix_candidates(1)[0]
    switchable = analysis.switchable
    switchable.quantize_only([name for name in switchable.layers if name != first])
    screened = switchable.run(batches[:1])
    switchable.quantize_only(switchable.layers)
    # the screen (one batch) meets the target by a hair with the worst layer in float; every batch decides
    fix = analysis.float_layers_fix(screened - 1e-6, max_batches=1, candidates=1)
    exact = _exact_db(float_gm, batches, list(fix.float_layers))
    assert fix.measured_db == exact and fix.reached == (exact >= screened - 1e-6)
    if fix.float_layers != (first,):  # the screen's set fell short on every batch; the widened one measured better
        assert exact > _exact_db(float_gm, batches, [first])


def test_layers_that_help_only_together_are_found():
    # FRAGILE's layers.2 helps only once layers.4 is in float: screened alone it gains nothing, yet the ladder
    # keeps it after the layers that help alone
    namespace = {}
    from tests.helpers import FRAGILE_SOURCE

    exec(compile(FRAGILE_SOURCE.replace("from pytest_qreport import qmodel", ""), "fragile", "exec"), namespace)
    model, batches = namespace["MLP"]().eval(), namespace["batches"]()
    analysis = ModelAnalysis(qcore.capture(model, batches[0]), batches=batches)
    fix = analysis.float_layers_fix(30.0)
    assert fix.reached and set(fix.float_layers) == {"layers.2", "layers.4"}
    assert fix.measured_db == _exact_db(analysis.float_gm, batches, list(fix.float_layers)) >= 30.0


def test_the_candidates_start_with_the_layer_nearest_each_output_then_the_largest_own_errors():
    import transformers

    from qcore.graph.ops import last_layers

    float_gm, batches = _llama()
    analysis = ModelAnalysis(float_gm, batches=batches)
    layers = [entry.layer for entry in analysis.layers]
    assert last_layers(float_gm, layers) == ["lm_head"]  # every path to the logits goes through it
    own = analysis.own_error_ranking()
    assert "lm_head" not in own[:4]  # its own error is not among the largest, yet it is a candidate
    candidates = analysis.fix_candidates(4)
    assert set(candidates[:4]) == {"lm_head", *own[:3]} and sorted(candidates) == sorted(layers)
    assert candidates[:4] == [name for name in own if name in candidates[:4]]  # largest own error first
    # a BERT encoder's two outputs: the last block's output projection feeds the hidden states (the residual stream
    # reaches them through no other layer), the pooler's dense its pooled output
    config = transformers.BertConfig(vocab_size=128, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                     intermediate_size=64, max_position_embeddings=32)
    torch.manual_seed(0)
    model = transformers.BertModel(config).eval()
    bert_batches = [{"input_ids": torch.randint(0, 128, (2, 16))} for _ in range(2)]
    bert_gm = qcore.capture(model, bert_batches[0])
    bert_layers = [entry.layer for entry in ModelAnalysis(bert_gm, batches=bert_batches).layers]
    found = last_layers(bert_gm, bert_layers)
    assert len(found) == 2 and found[-1].startswith("pooler") and found[0].endswith("output.dense")
