"""Cost of the per-layer sensitivity ranking, and what the verified float_layers fix buys.

1. A BERT-style encoder (transformers.BertModel, 6 layers, hidden 256, seeded random weights; 8 batches of
   4x64 tokens): one plain analysis (capture, calibrate, quantize, SQNR) against the sensitivity ranking over
   every quantized layer on 2 batches, and with a layer budget; the same ranking done the naive way
   (re-preparing and re-calibrating the model once per layer) for scale.
2. Resumed runs (qcore.search.resume): the ranking over every layer and a float_layers search that never reaches its
   target (so all 8 greedy steps run), with each trial run from the last recorded cut before the layer it
   changes, against the same with every trial run whole, in the same process; the results must be equal. On
   the BERT-style encoder and a 4-layer Llama (transformers.LlamaConfig, hidden 512, 2 batches of 2 x 128 tokens).
3. Estimates (find_float_layers' estimate=True, the default): the float_layers search as model_sqnr runs it (its
   own ranking, 8 greedy steps), every setting estimated on the first of the 2 search batches and the best
   measured on both, against every setting measured on both; the picks, the SQNR they reach and the time of each,
   alternated in the same process, on the same two models.
4. A model built to fail model_sqnr (examples/models.py fragile_mlp): the greedy fix's measured SQNR and size,
   against how many layers of the single-layer ranking, taken in order, reach the same target.
5. Screen, then confirm: the float_layers fix as model_sqnr searches it (ModelAnalysis.float_layers_fix: the 8
   candidates screened on 2 batches, the set measured on every batch, the screen widened to the first 32 layers in
   graph order when that set falls short) against the greedy search alone (find_float_layers without a ranking), for
   targets 1, 3 and 6 dB above the model's output SQNR, on the same two models: seconds (best of two, alternated,
   the analysis and its switchable copy built outside the time), layers kept in float, the SQNR measured.
6. An exact measurement of a set of layers kept in float, as the search confirms one (measured_output_sqnr: the
   model's calibrated observers taken, the outputs compared against the switches' float outputs), against a pass of
   its own (measure_sqnr without the shadow: calibration and a per-layer comparison), alternated, best of two; the
   SQNR must be equal. On the 4-layer Llama, or with --llama1b on the 1B Llama config (bench_ops.py's: 3 batches of
   2 x 64 tokens, minutes).

    python benchmarks/bench_sensitivity.py                      # parts 1 to 6
    python benchmarks/bench_sensitivity.py --screen             # part 5 only
    python benchmarks/bench_sensitivity.py --exact [--llama1b]  # part 6 only
"""
from __future__ import annotations

import pathlib
import sys
import time
from typing import Any

import torch

import qcore
from qcore.analysis import ModelAnalysis, measure_sqnr
from qcore.search.sensitivity import find_float_layers, with_float_layers

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent / "examples"))


def _bert():
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
    from bench_analysis import _case

    return _case("bert")


def _timed(function):
    start = time.perf_counter()
    value = function()
    return value, time.perf_counter() - start


def bench_cost() -> None:
    torch.set_num_threads(2)
    model, batches = _bert()
    float_gm = qcore.capture(model, batches[0])
    _, plain = _timed(lambda: ModelAnalysis(float_gm, batches=batches).sqnr)
    analysis = ModelAnalysis(float_gm, batches=batches)
    analysis.sqnr  # noqa: B018 - the analysis the ranking adds to
    layers = len(analysis.layers)
    _, switches = _timed(lambda: analysis.switchable)
    ranking, full = _timed(lambda: analysis.sensitivity(None, 2))
    _, budget = _timed(lambda: analysis.sensitivity(16, 2))
    quantizer = qcore.Int8StaticQuantizer()
    sample = [entry.layer for entry in analysis.layers[:4]]
    _, naive = _timed(lambda: [measure_sqnr(float_gm, batches[:2], with_float_layers(quantizer, [layer]))
                               for layer in sample])
    naive_all = naive / len(sample) * layers
    print(f"BERT-style encoder, {layers} quantized layers, 2 cores")
    print(f"  one plain analysis (8 batches):                  {plain:7.2f} s")
    print(f"  switchable copy (prepare + calibrate, once):       {switches:7.2f} s")
    print(f"  ranking, every layer, 2 batches:                 {full:7.2f} s  = {(switches + full) / plain:5.2f}x "
          "the analysis")
    print(f"  ranking, budget of 16 layers, 2 batches:         {budget:7.2f} s  = {(switches + budget) / plain:5.2f}x")
    print(f"  naive (re-prepare per layer, 2 batches), all:    {naive_all:7.2f} s  = {naive_all / plain:5.2f}x "
          f"(extrapolated from {len(sample)} layers)")
    print(f"  all quantized: {ranking.all_quantized_db:.1f} dB; top: " + ", ".join(
        f"{e.layer} {e.gain_db:+.2f}" for e in ranking.layers[:3]))


def bench_fix() -> None:
    from models import fragile_mlp

    g = torch.Generator().manual_seed(1)
    batches = [torch.randn(32, 64, generator=g) for _ in range(8)]
    float_gm = qcore.capture(fragile_mlp(), batches[0])
    for target in (20.0, 30.0):
        fix, seconds = _timed(lambda: find_float_layers(float_gm, batches, None, target,  # noqa: B023
                                                        compare_with_ranking=True))
        naive = f"{fix.naive_top_k} layers" if fix.naive_top_k else "not within 8 layers"
        print(f"fragile MLP, target {target:.0f} dB: float_layers={list(fix.float_layers)} measured "
              f"{fix.measured_db:.1f} dB (estimated {fix.estimated_db:.1f}) in {seconds:.2f} s; the ranking's "
              f"top-k needs {naive}")


def _llama():
    import transformers

    config = transformers.LlamaConfig(vocab_size=4096, hidden_size=512, intermediate_size=1376, num_hidden_layers=4,
                                      num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=128,
                                      use_cache=False)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).eval()
    g = torch.Generator().manual_seed(0)
    return model, [{"input_ids": torch.randint(0, 4096, (2, 128), generator=g)} for _ in range(2)]


def _both_ways(build, search, flag_is_resume=False):
    """{flag: search(float_gm, batches, switchable, flag)}, {flag: best seconds} for flag False, True, False, True
    (alternated: this machine's speed drifts), on the model and first 2 batches `build()` gives; the switchable copy
    (SwitchableModel; with flag_is_resume, the flag is its `resume`) is built outside the time."""
    from qcore.search.sensitivity import SwitchableModel

    model, batches = build()
    batches = batches[:2]
    float_gm = qcore.capture(model, batches[0])
    results, seconds = {}, {}
    for flag in (False, True, False, True):
        switchable = SwitchableModel(float_gm, batches, resume=flag or not flag_is_resume)
        start = time.perf_counter()
        results[flag] = search(float_gm, batches, switchable, flag)
        seconds[flag] = min(seconds.get(flag, float("inf")), time.perf_counter() - start)
    return results, seconds


def bench_resume() -> None:
    from qcore.search.sensitivity import layer_sensitivity

    torch.set_num_threads(2)

    def resumed(float_gm, batches, switchable, resume):
        ranking = layer_sensitivity(float_gm, batches, model=switchable, only_quantized=False)
        fix = find_float_layers(float_gm, batches, None, 200.0, sensitivity=ranking, model=switchable)
        return ranking, fix.float_layers, fix.estimated_db, len(switchable.layers)

    for name, build in (("BERT-style encoder", _bert), ("4-layer Llama", _llama)):
        results, seconds = _both_ways(build, resumed, flag_is_resume=True)
        assert results[True] == results[False], "resumed runs changed the results"
        print(f"{name}, {results[True][3]} layers, ranking + 8-step search on 2 batches: whole runs "
              f"{seconds[False]:.2f} s, resumed {seconds[True]:.2f} s: {seconds[False] / seconds[True]:.2f}x "
              "(equal results)")


def bench_estimate() -> None:
    torch.set_num_threads(2)

    def estimated(float_gm, batches, switchable, estimate):
        fix = find_float_layers(float_gm, batches, None, 200.0, model=switchable, estimate=estimate)
        return fix.float_layers, fix.estimated_db, fix.measured_db

    for name, build in (("BERT-style encoder", _bert), ("4-layer Llama", _llama)):
        results, seconds = _both_ways(build, estimated)
        same = "the same picks" if results[True][0] == results[False][0] else (
            f"other picks: {list(results[True][0])} against {list(results[False][0])}")
        print(f"{name}, 8-step float_layers search with its ranking, 2 batches: every setting on both "
              f"{seconds[False]:.2f} s, estimated on the first {seconds[True]:.2f} s: "
              f"{seconds[False] / seconds[True]:.2f}x; {same}, measured {results[True][2]:.2f} dB against "
              f"{results[False][2]:.2f} dB")


def bench_screen() -> None:
    torch.set_num_threads(2)
    for name, build in (("BERT-style encoder", _bert), ("4-layer Llama", _llama)):
        model, batches = build()
        float_gm = qcore.capture(model, batches[0])
        for gain in (1.0, 3.0, 6.0):
            best: dict[str, tuple[float, Any]] = {}
            for way in ("greedy", "screen", "greedy", "screen"):
                analysis = ModelAnalysis(float_gm, batches=batches)
                target = analysis.sqnr.worst_output().sqnr_db + gain
                switchable = analysis.switchable
                start = time.perf_counter()
                fix = (analysis.float_layers_fix(target) if way == "screen" else find_float_layers(
                    analysis.quantized_input_gm, analysis.batches, analysis.quantizer, target, model=switchable))
                seconds = time.perf_counter() - start
                best[way] = (min(seconds, best[way][0]) if way in best else seconds, fix)

            def said(way: str, found: dict = best) -> str:
                seconds, fix = found[way]
                return (f"{way} {seconds:.2f} s, {len(fix.float_layers)} layers, {fix.measured_db:.2f} dB "
                        f"{'reached' if fix.reached else 'short'}")

            print(f"{name}, target +{gain:.0f} dB ({target:.2f} dB): {said('greedy')}; {said('screen')}: "
                  f"{best['greedy'][0] / best['screen'][0]:.2f}x")


def _llama1b():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=2048, intermediate_size=5632, num_hidden_layers=16, num_attention_heads=32,
                         num_key_value_heads=8, vocab_size=32000, use_cache=False)
    generator = torch.Generator().manual_seed(1)
    return (LlamaForCausalLM(config).eval(),
            [{"input_ids": torch.randint(0, 32000, (2, 64), generator=generator)} for _ in range(3)])


def bench_exact(large: bool) -> None:
    from qcore.analysis import measure_sqnr, with_float_layers
    from qcore.search.sensitivity import measured_output_sqnr

    torch.set_num_threads(2)
    model, batches = _llama1b() if large else _llama()
    float_gm = qcore.capture(model, batches[0])
    analysis = ModelAnalysis(float_gm, batches=batches)
    analysis.sqnr.worst_output()  # the model's pass calibrates the observers the exact measurement takes
    switchable = analysis.switchable
    switchable.quantize_only(switchable.layers)
    switchable.run(batches[:2])  # the search batches' float outputs, as the search holds them
    quantizer = with_float_layers(analysis.quantizer, analysis.fix_candidates(2)[:2])
    ways = {"exact": lambda: measured_output_sqnr(float_gm, batches, quantizer, switchable.reference,
                                                  analysis._observers),
            "own pass": lambda: measure_sqnr(float_gm, batches, quantizer, shadow=False).worst_output().sqnr_db}
    best: dict[str, tuple[float, float]] = {}
    for way in ["exact", "own pass"] * 2:
        start = time.perf_counter()
        value = ways[way]()
        seconds = time.perf_counter() - start
        best[way] = (min(seconds, best[way][0]) if way in best else seconds, value)
    print(f"{'1B Llama config' if large else '4-layer Llama'}, 2 layers in float: exact {best['exact'][0]:.2f} s "
          f"({best['exact'][1]:.4f} dB), own pass {best['own pass'][0]:.2f} s ({best['own pass'][1]:.4f} dB): "
          f"{best['own pass'][0] / best['exact'][0]:.2f}x, equal: {best['exact'][1] == best['own pass'][1]}")


if __name__ == "__main__":
    if sys.argv[1:] == ["--screen"]:
        bench_screen()
        raise SystemExit
    if sys.argv[1:2] == ["--exact"]:
        bench_exact("--llama1b" in sys.argv)
        raise SystemExit
    bench_screen()
    bench_resume()
    bench_estimate()
    bench_fix()
    bench_cost()
    bench_exact(False)
