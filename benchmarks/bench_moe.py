"""How many calibration tokens an expert needs: the measurement behind expert_coverage's default (32 tokens).

A tiny Qwen3-MoE (transformers 5, 8 experts, top-2, seeded weights of trained scale) is run on 64 batches of 64
tokens. For each expert, the tokens routed to its first projection are split: the last half is held out, and a
static int8 activation range (qcore's MinMaxObserver, as the default quantizer calibrates) is taken from the first
n of the rest. The printed figure is the SQNR of the held-out tokens fake-quantized with that range, against the
range of every calibration token, median and worst over the experts, for each n. An expert that received few
tokens gets a range too narrow for the tokens it meets later, and the held-out tokens clip.

With `--cost`: the analysis of a Qwen3-MoE and of the dense Qwen3 of the same depth and shape (its MLP as wide as
the top-k experts a token goes through: the same compute per token), every default check under int8, verdicts only
(fix_budget=0) and the default run (fix_budget=1), each against its own eager forward over the same batches, in one
process, at each size asked for: `tiny` (4 blocks of 8 experts of 128, top-2, hidden 128, 8 batches of 4x16 tokens:
per-op overhead dominates), `small` (the same with hidden 1024, experts of 512, 8 batches of 4x128 tokens: compute
dominates) and `30b-a3b` (2 blocks shaped like Qwen3-30B-A3B's, 128 experts of 768, top-8, hidden 2048, 8 batches of
4x128 tokens: 32 routed tokens an expert a batch, about 6 GiB; not in the default sizes). The two models are
measured in alternating rounds (11 at `tiny`, 2 at `small`, 1 at `30b-a3b`; each a forward, the fastest of passes
repeated for a second, and both analyses), each figure the fastest of its rounds. `moe/dense` is the MoE's ratio
over the dense model's; `median` and `per round`, the median and the range of that quotient over the rounds; below
the table, each analysis's stages against its model's forward, and the part of them spent quantizing the weights of
a model above 256 MiB of weights each time they are read. `--rounds N` runs N rounds at every size; `--device cuda`
runs the models, batches and analyses on a GPU (each time synchronized); `--checks sqnr,weight_sqnr,...` runs those
checks instead of every default one: where among the checks the MoE's extra cost lies; `--tokens N` gives each batch
row N tokens instead of the size's (an expert's share of the calibration grows with them). Last, the layers each
detector's screen measured its fix on (a screen runs one more copy of each such layer in the comparison pass). The
MoE's analysis captures its fused experts one op a projection, as the plugin's does; `--per-expert` adds the same
MoE captured with one Linear per expert (`experts_grouped(False)`) as a third model of the rounds, "per-expert".

With `--peak [--sizes small,30b-a3b]`: the peak memory of one analysis (every default check, the default run) of
`--cost`'s dense model, its MoE (experts one op a projection) and its MoE captured one Linear per expert, each alone
in a subprocess: its seconds and its peak resident memory above what the built pair holds (a model above 256 MiB
of weights has them quantized where read, as the plugin does).

With `--where-read`: one read of an expert weight quantized where read (128 experts' [768, 2048] float32 weights,
each read from memory), with the native kernel's arguments made at each read, kept per qparams (what convert
builds), one expert of the same weights held as a grouped projection's weight (every expert's arguments kept), and
the kernel alone, in alternating rounds.

With `--where-read-trace [--sizes 30b-a3b]`: each read of one verdicts-only analysis of the MoE (weights quantized
where read) timed apart, by graph run in order, against the same kernel over the model's own expert weights in a
loop apart from the analysis (where_read_trace).

With `--where-read-stores [--seconds 60] [--threads N]`: an expert weight quantized where read into its reused
buffer, then its matmul over 32 routed tokens (what each expert of an analysis's graph runs does), with the
kernel's plain stores and its streaming stores alternately, over the same 128 experts' [768, 2048] float32
weights: the medians of each 2-second window. A cloud VM's two vCPUs move between sharing an L3 and not, from one
window to the next; the plain stores' read takes five times as long in the windows where they do not
(where_read_stores). `--threads 1` runs torch on one thread, streaming forced on: the case where the plugin keeps
plain stores.

With `--compare-sums`: qcore's comparator-sums kernel (every comparator's update, every weight's SQNR) with its sums
added as lane vectors, as qcore builds it, against the same source built with the scalar loop, at an MoE expert's
sizes and a dense layer's, their sums checked bit for bit (compare_sums_cost).

With `--shadow-pairs`: a layer's own shadow and a screen's shadow multiplying by one weight as two matmuls and as one
over both inputs' rows (qcore's linear_on_rows_together), at an MoE expert's rows and weights and around the size
limit, their results' largest difference beside (shadow_pairs_cost).

With `--functions [--sizes 30b-a3b]`: the seconds the comparison pass's graph runs, calibration and the graph building
around them take in one verdicts-only analysis of `--cost`'s dense model and its MoE, against each forward
(function_times).

With `--native-calls [--sizes 30b-a3b]`: each native kernel's calls and time in one verdicts-only analysis of
`--cost`'s dense model and its MoE, against each forward (native_calls).

With `--capture`: the capture of a 2-block Qwen3-MoE with 128 experts per block (hidden 128), traced once per
block from expert 0's template (the default) against a trace of every expert, best of 2 each.

With `--experts 8,32,64,128`: the analysis of a 4-block Qwen3-MoE as its expert count grows (experts_cost).

With `--shared-weights [--sizes tiny,small]`: the MoE of `--cost`'s pair, verdicts only, with a screen's quantized
copy sharing the weights the model's convert quantized the same way (`convert(..., weights_from=)`) and without
(each copy quantizing its layers' weights again), in alternating rounds: the screens' copies' seconds and the
analysis's, each the fastest of its rounds, and the MiB of quantized weights the copies share (a copy that
quantizes them again holds them twice while the comparison pass runs).

With `--grouped-floor [--sizes tiny,small]`: what the per-expert layers cost. `--cost`'s pair, verdicts only, in
alternating rounds, and the MoE captured a third way: its experts left as transformers computes them (one grouped
op a projection, neither quantized nor measured), the floor of an analysis that would measure a projection's
experts as one op. Each figure the median of its rounds' analysis over forward.

With `--grouped-sqnr [--sizes tiny,small]`: the capture and `qcore.analysis.measure_sqnr` (int8 static: calibration,
convert, and the comparison pass with every layer's shadow; no detector), and the capture and a `ModelAnalysis` of
the SQNR with torch.ao's four detectors and expert coverage in the same passes, of `--cost`'s pair, the MoE captured
both ways: one Linear per expert (what the analysis runs today) and with each projection one grouped op
(`qcore.graph.capture.experts_grouped()`, which gives every expert's records and report entries, the same values),
each against its forward, in alternating rounds (11 at `tiny`, 2 at `small`), each figure the median of its rounds.

With `--ops [--sizes tiny] [--checks sqnr,...]`: `--cost`'s pair, verdicts only: the aten ops one analysis runs
(counted at dispatch, after a first analysis that is not counted) against those of the model's eager forward over
the same batches, by op, the ops whose share of the MoE's analysis most exceeds their share of the dense model's
first. Below it, whether the grouped forms a projection's experts measured as one op would compute with give the
per-expert forms' values bit for bit on this machine: torch's grouped_mm against one linear per expert, and one
fake quantization per row with each row's expert's int8 qparams (qcore's per-channel kernel) against one per-tensor
fake quantization per expert.

    python benchmarks/bench_moe.py [--cost [--sizes tiny,small,30b-a3b] [--checks sqnr,...] [--tokens N] [--per-expert]
                                           [--rounds N] [--device cuda]
                                           [--quantizer W4A16]]
                                   [--peak [--sizes small,30b-a3b]]
                                   [--experts 8,32,64,128] [--capture] [--where-read]
                                   [--where-read-trace [--sizes 30b-a3b]]
                                   [--where-read-stores [--seconds 60] [--threads N]]
                                   [--compare-sums] [--shadow-pairs] [--functions [--sizes 30b-a3b]]
                                   [--native-calls [--sizes 30b-a3b]]
                                   [--ops [--sizes tiny] [--checks ...]]
                                   [--shared-weights [--sizes tiny,small]] [--grouped-floor [--sizes tiny,small]]
                                   [--grouped-sqnr [--sizes tiny,small]]
"""
from __future__ import annotations

import contextlib
import dataclasses
import os
import pathlib
import resource
import statistics
import sys
import time
from dataclasses import dataclass
from typing import Any

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))
from bench_analysis import _forward_seconds  # noqa: E402

from qcore.numeric import compute_sqnr  # noqa: E402
from qcore.observe.observers import MinMaxObserver  # noqa: E402
from qcore.observe.qparams import fake_quantize_per_tensor  # noqa: E402
from tests.models import routed_tokens as routed_tokens_of  # noqa: E402
from tests.models import tiny_moe  # noqa: E402

COUNTS = (1, 2, 4, 8, 16, 32, 64, 128, 256)


def routed_tokens(experts: int = 8, batches: int = 64) -> dict[int, torch.Tensor]:
    """{expert: the hidden states the eager model routes to it, in order}."""
    model, data = tiny_moe("qwen3_moe", experts=experts, batch=4, n=batches)
    routed = routed_tokens_of(model, data)
    return {expert: torch.cat(chunks) for expert, chunks in routed.items()}


def held_out_sqnr(tokens: torch.Tensor, count: int) -> float:
    """SQNR of the held-out half of `tokens` quantized with the int8 range of the first `count` of the rest."""
    calibration, held_out = tokens[: len(tokens) // 2], tokens[len(tokens) // 2:]
    observer = MinMaxObserver(dtype=torch.int8)
    observer(calibration[:count])
    scale, zero_point = observer.calculate_qparams()
    quantized = fake_quantize_per_tensor(held_out, float(scale), int(zero_point), -128, 127)
    return float(compute_sqnr(held_out, quantized))


def timed_into(total: list[float], function, called_from: set | None = None, each: list | None = None,
               outermost: bool = False):
    """`function`, adding the seconds each call takes to total[0]; with `called_from` (code objects), only those of
    the calls made from those functions' code; with `each`, each timed call's (the graph code it was made from,
    seconds) appended to it too; with `outermost`, a call made inside a timed call is not timed again."""
    running = [False]

    def timed(*arguments, **keywords):
        if (called_from is not None and sys._getframe(1).f_code not in called_from) or running[0]:
            return function(*arguments, **keywords)
        running[0] = outermost
        started = time.perf_counter()
        try:
            return function(*arguments, **keywords)
        finally:
            running[0] = False
            seconds = time.perf_counter() - started
            total[0] += seconds
            if each is not None:
                each.append((_graph_code(sys._getframe(1)), seconds))
    return timed


def _graph_code(frame) -> str:
    """The generated code of the graph whose run `frame` belongs to ("<eval_with_key>.N"), or "outside a graph"."""
    while frame is not None and not frame.f_code.co_filename.startswith("<eval_with_key>"):
        frame = frame.f_back
    return frame.f_code.co_filename if frame is not None else "outside a graph"


@contextlib.contextmanager
def where_read_timed(total: list[float], each: list | None = None):
    """Within the block, total[0] gains the seconds that weights quantized where read take (and `each`, when given,
    each read's graph code and seconds): the quantizations that
    convert's fake_quantize_where_read and fake_quantize_over_input make (timed where they call the kernels), and each
    expert of a grouped projection quantized before its matmul. The graphs still call convert's own functions: qcore
    tells those nodes by their target (a screen's shadow that changes only activations shares the model's shadow's
    quantization: merge_repeated_shadow_weights), which a timed stand-in in their place would defeat."""
    import qcore.quantization.convert as convert_module
    from qcore.observe.segmented import ExpertsQuantizedWhereRead

    callers = {convert_module.fake_quantize_where_read.__code__, convert_module.fake_quantize_over_input.__code__}
    kernels = {name: getattr(convert_module, name) for name in ("fake_quantize_rows", "fake_quantize_per_channel")}
    expert = ExpertsQuantizedWhereRead.expert
    try:
        for name, function in kernels.items():
            setattr(convert_module, name, timed_into(total, function, callers, each))
        ExpertsQuantizedWhereRead.expert = timed_into(total, expert, each=each)
        yield
    finally:
        for name, function in kernels.items():
            setattr(convert_module, name, function)
        ExpertsQuantizedWhereRead.expert = expert


def _analysis_seconds(model, batches, fix_budget: float, checks: list[str] | None = None,
                      screened: dict[str, int] | None = None,
                      reads: list | None = None) -> tuple[float, int, int, dict[str, float]]:
    """(seconds from capture to every finding, items, failing items, seconds per stage) of `checks` (default: every
    default check), as the plugin runs them. `screened`, when given, gets the layers each screen measured a fix on
    in the comparison pass ({screen: layers}; "layers" is every layer the analysis measured)."""
    from pytest_qreport.checks import BUILTIN_CHECKS
    from pytest_qreport.core.pipeline import collect_model
    from pytest_qreport.core.quantizers import pytest_qreport_make_quantizer
    from pytest_qreport.core.registry import CheckRegistry
    from pytest_qreport.core.settings import ModelSettings

    registry = CheckRegistry()
    for check in BUILTIN_CHECKS:
        registry.register(check)
    checks = checks or [check.name for check in BUILTIN_CHECKS if check.default_severity != "off"]
    on_device = {"device": DEVICE} if DEVICE != "cpu" else {}
    settings = ModelSettings.defaults(BUILTIN_CHECKS, calibration=batches, checks=checks, fix_budget=fix_budget,
                                      **on_device)
    where_read = [0.0]  # the seconds a large model's weights take to be quantized each time they are read
    with where_read_timed(where_read, reads):
        _synchronize()
        start = time.perf_counter()
        state = collect_model("model", settings, registry, pytest_qreport_make_quantizer(QUANTIZER), model, batches[0])
        state.analyze(lambda: batches, lambda found: None, threads=2)
        _synchronize()
    assert not state.failed, state.error
    if screened is not None:
        analysis = state.context.analysis
        screened["layers"] = len(analysis.sqnr.layers)
        screened.update({name: len(found.changes) for name, found in analysis.measurement.screens.items()})
    findings = (state.findings or {}).values()
    return (time.perf_counter() - start, len(findings), sum(f.verdict in ("fail", "warn") for f in findings),
            {**state.seconds, "weights quantized where read": where_read[0]})


ROUNDS = {"tiny": 11, "small": 2, "30b-a3b": 1}  # rounds of (forward, analysis) per model, the fastest quoted
DEVICE = "cpu"  # --device: where --cost's models, batches and analyses run
QUANTIZER = "int8"  # --quantizer: the plugin's name of the quantizer --cost's analyses run under


def _synchronize() -> None:
    """Wait for the GPU's queued work when --cost runs on one (nothing on the CPU)."""
    if DEVICE != "cpu":
        torch.cuda.synchronize()
STEADY_SECONDS = 1.0  # a round's forward: passes over the batches for at least this long, the fastest taken


def steady_forward_seconds(model, batches) -> float:
    """The fastest of at least three passes of the eager forward over `batches`, passes repeated for at least
    STEADY_SECONDS: a toy model's pass takes 15-30 ms, whose best of three moves by a third from round to round."""
    import torch

    from qcore.graph.inputs import call_model

    best, spent, passes = float("inf"), 0.0, 0
    with torch.no_grad():
        while passes < 3 or spent < STEADY_SECONDS:
            _synchronize()
            start = time.perf_counter()
            for batch in batches:
                call_model(model, batch)
            _synchronize()
            took = time.perf_counter() - start
            best, spent, passes = min(best, took), spent + took, passes + 1
    return best


@dataclass(frozen=True)
class Size:
    """A size of --cost's pair: the MoE's shape, and tokens per batch row (8 batches of 4 rows)."""

    hidden: int
    width: int  # an expert's intermediate size
    experts: int
    top_k: int
    layers: int
    heads: int
    head_dim: int
    tokens: int
    vocabulary: int


SIZES: dict[str, Size] = {
    "tiny": Size(128, 128, 8, 2, 4, 8, 16, 16, 128),
    "small": Size(1024, 512, 8, 2, 4, 8, 128, 128, 1024),
    # Qwen3-30B-A3B's blocks (2 of its 48) with a small vocabulary: 32 routed tokens an expert a batch
    "30b-a3b": Size(2048, 768, 128, 8, 2, 32, 128, 128, 1024),
}


def pair(size: str, tokens: int | None = None):
    """(the MoE, the dense model of its depth and compute per token, 8 batches of 4 rows of `tokens` tokens (default:
    the size's)), seeded."""
    import transformers

    shape = SIZES[size] if tokens is None else dataclasses.replace(SIZES[size], tokens=tokens)
    common = dict(vocab_size=shape.vocabulary, hidden_size=shape.hidden, num_hidden_layers=shape.layers,
                  num_attention_heads=shape.heads, num_key_value_heads=4, head_dim=shape.head_dim,
                  max_position_embeddings=512, use_cache=False)
    dense_width = shape.top_k * shape.width  # the MLP of the experts a token goes through, side by side
    models = []
    for config in (transformers.Qwen3MoeConfig(**common, intermediate_size=dense_width,
                                               moe_intermediate_size=shape.width, num_experts=shape.experts,
                                               num_experts_per_tok=shape.top_k),
                   transformers.Qwen3Config(**common, intermediate_size=dense_width)):
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(config).eval()
        with torch.no_grad():
            for parameter in model.parameters():
                if parameter.dim() > 1:
                    parameter.normal_(0.0, 0.05 if shape.hidden <= 256 else 0.02)  # trained scale: routers choose
        models.append(model)
    generator = torch.Generator().manual_seed(0)
    batches = [{"input_ids": torch.randint(0, shape.vocabulary, (4, shape.tokens), generator=generator).to(DEVICE)}
               for _ in range(8)]
    return models[0].to(DEVICE), models[1].to(DEVICE), batches


def cost(sizes: list[str], checks: list[str] | None = None, tokens: int | None = None,
         per_expert: bool = False) -> None:
    """The table of --cost: the two models measured in alternating rounds, so that the machine's drift (its speed
    moves by a tenth from minute to minute) falls on both alike; each figure the fastest of its rounds, and the
    spread of the per-round ratio beside it. Below it, where each analysis's time goes (its fastest round): the
    capture, the calibration and comparison passes, the fix searches' trials and the rest (graph building and
    reading the results), each against the model's forward, and the layers each detector's screen measured a fix
    on. `checks`: the checks run (default: every default check); `tokens`: tokens per batch row (default: the
    size's); `per_expert`: the MoE analysed a third time captured with one Linear per expert
    (experts_grouped(False)), measured in the same rounds ("per-expert"), beside the default analysis, which
    captures the fused experts one op a projection."""
    from qcore.graph.capture import experts_grouped

    def capture_form(name: str) -> contextlib.AbstractContextManager:
        return experts_grouped(False) if name == "per-expert" else contextlib.nullcontext()

    print(f"quantizer: {QUANTIZER}; checks: {','.join(checks) if checks else 'every default check'}"
          + (f"; {tokens} tokens a row" if tokens else ""))
    print(f"{'size':>6} {'fix_budget':>10} {'model':>6} {'forward s':>10} {'analysis s':>11} {'items':>6} "
          f"{'failing':>7} {'ratio':>7} {'moe/dense':>9} {'median':>6} {'per round':>17}")
    splits, screens = [], []
    for size in sizes:
        moe, dense, batches = pair(size, tokens)
        models = (("dense", dense), ("moe", moe), *((("per-expert", moe),) if per_expert else ()))
        forwards: dict[str, list[float]] = {name: [] for name, _ in models}
        analyses: dict[tuple[str, float], list[tuple[float, dict[str, float]]]] = {}
        items: dict[str, int] = {}
        failing: dict[tuple[str, float], int] = {}
        for name, model in models:  # the first analysis in a process pays its one-time costs: not measured
            with capture_form(name):
                _analysis_seconds(model, batches, 0.0, checks)
        for _ in range(ROUNDS[size]):
            for name, model in models:
                forwards[name].append(steady_forward_seconds(model, batches))
                for budget in (0.0, 1.0):
                    screened: dict[str, int] = {}
                    with capture_form(name):
                        seconds, items[name], failing[name, budget], stages = _analysis_seconds(
                            model, batches, budget, checks, screened)
                    analyses.setdefault((name, budget), []).append((seconds, stages))
                if len(forwards[name]) == 1:
                    screens.append(f"{size:>6} {name:>6} {screened.pop('layers')} layers; " + (", ".join(
                        f"{screen} {count}" for screen, count in sorted(screened.items())) or "no screen"))
        for budget in (0.0, 1.0):
            fastest = {name: min(analyses[name, budget], key=lambda found: found[0]) for name, _ in models}
            ratios = {name: fastest[name][0] / min(forwards[name]) for name, _ in models}
            for name, _ in models:
                rounds = [(analyses[name, budget][r][0] / forwards[name][r])
                          / (analyses["dense", budget][r][0] / forwards["dense"][r]) for r in range(ROUNDS[size])]
                relative = (f"{ratios[name] / ratios['dense']:>9.2f} {statistics.median(rounds):>6.2f} "
                            f"{min(rounds):>8.2f}-{max(rounds):<8.2f}" if name != "dense" else "")
                print(f"{size:>6} {budget:>10g} {name:>6} {min(forwards[name]):>10.3f} {fastest[name][0]:>11.2f} "
                      f"{items[name]:>6} {failing[name, budget]:>7} {ratios[name]:>6.1f}x {relative}")
                stages = fastest[name][1]
                splits.append(f"{size:>6} {budget:>10g} {name:>6} " + ", ".join(
                    f"{stage} {stages.get(stage, 0.0) / min(forwards[name]):.1f}x"
                    for stage in ("capture", "calibration", "comparison", "verdict trials", "trials", "other"))
                    + f"; of these, weights quantized where read "
                    f"{stages.get('weights quantized where read', 0.0) / min(forwards[name]):.2f}x")
    print("where the time goes, against the model's forward (the fastest round):")
    print("\n".join(splits))
    print("the layers each screen measured its fix on (fix_budget 1, the first round):")
    print("\n".join(screens))
    print(f"peak RSS {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20:.2f} GiB"
          + (f"; peak GPU memory {torch.cuda.max_memory_allocated() / 2**30:.2f} GiB" if DEVICE != "cpu" else ""))


def _resident_bytes() -> int:
    """This process's resident memory now (VmRSS)."""
    for line in pathlib.Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) << 10
    return 0


def peak_of_one(size: str, form: str) -> None:
    """One analysis (every default check, the default run) of `form` ("dense", "moe" or "per-expert") of the size's
    pair, in this process: the seconds, and the peak resident memory above what the built models hold."""
    from qcore.graph.capture import experts_grouped

    moe, dense, batches = pair(size)
    held = _resident_bytes()
    with experts_grouped(False) if form == "per-expert" else contextlib.nullcontext():
        seconds, items, _, _ = _analysis_seconds(dense if form == "dense" else moe, batches, 1.0)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss << 10
    print(f"{size} {form} {seconds:.1f} {items} {held / 2**30:.2f} {(peak - held) / 2**30:.2f}")


def peak_memory(sizes: list[str]) -> None:
    """The table of --peak: each form's analysis alone in a subprocess (so that its peak is its own)."""
    import subprocess

    print(f"{'size':>7} {'model':>10} {'analysis s':>10} {'items':>6} {'models GiB':>10} {'peak above GiB':>14}")
    for size in sizes:
        for form in ("dense", "moe", "per-expert"):
            line = subprocess.run([sys.executable, __file__, "--peak-of", size, form], capture_output=True, text=True,
                                  check=True).stdout.strip().splitlines()[-1].split()
            print(f"{line[0]:>7} {line[1]:>10} {line[2]:>10} {line[3]:>6} {line[4]:>10} {line[5]:>14}")


def experts_cost(counts: list[int]) -> None:
    """The table of --experts: tests.models' tiny Qwen3-MoE with 4 blocks (hidden 128, experts of 128, top-2) and
    more and more experts, each expert routed the same tokens on average (8 batches of 4 rows of 2 x experts tokens),
    every default check under int8, verdicts only: the analysis against the forward, its stages, the failing items
    and the experts no calibration token reached (a few always are, at 128). Each figure the fastest of 2 rounds."""
    from qcore.analysis import ModelAnalysis  # noqa: F401 - imported before the first round is timed

    print(f"{'experts':>7} {'expert layers':>13} {'forward s':>9} {'analysis s':>10} {'ratio':>7} {'failing':>7} "
          f"{'unreached':>9}  stages against the forward, ms of graph building an expert layer")
    for count in counts:
        model, batches = tiny_moe("qwen3_moe", layers=4, experts=count, batch=4, tokens=2 * count, n=8,
                                  positions=1024)
        unreached = sum(not any(len(chunk) for chunk in chunks) for block in range(4)
                        for chunks in routed_tokens_of(model, batches, layer=block).values())
        _analysis_seconds(model, batches, 0.0)  # one-time costs, not measured
        best = None
        for _ in range(2):
            forward = _forward_seconds(model, batches)
            seconds, _, failing, stages = _analysis_seconds(model, batches, 0.0)
            if best is None or seconds / forward < best[0] / best[1]:
                best = (seconds, forward, failing, stages)
        seconds, forward, failing, stages = best
        layers = 4 * count * 3
        split = ", ".join(f"{stage} {value / forward:.1f}x" for stage, value in stages.items())
        print(f"{count:>7} {layers:>13} {forward:>9.3f} {seconds:>10.2f} {seconds / forward:>6.1f}x {failing:>7} "
              f"{unreached:>9}  {split}; {stages.get('other', 0.0) / layers * 1e3:.1f} ms")


def capture_cost() -> None:
    import qcore.graph.capture as capture_module

    model, batches = tiny_moe("qwen3_moe", layers=2, experts=128, batch=8, tokens=32)
    templates = capture_module.traced_with_templates
    seconds, nodes = {}, {}
    for label, context in (("template per block", templates), ("every expert traced", contextlib.nullcontext)):
        capture_module.traced_with_templates = context
        best = float("inf")
        for _ in range(2):
            start = time.perf_counter()
            graph = capture_module.capture(model, batches[0])
            best = min(best, time.perf_counter() - start)
        seconds[label], nodes[label] = best, len(graph.graph.nodes)
    capture_module.traced_with_templates = templates
    for label in seconds:
        print(f"{label:>20}: {seconds[label]:6.2f} s, {nodes[label]} nodes")
    print(f"ratio: {seconds['every expert traced'] / seconds['template per block']:.1f}x")


def shared_weights_cost(sizes: list[str]) -> None:
    """The table of --shared-weights."""
    import qcore.measure.passes as passes
    import qcore.quantization.convert as convert_module

    original_find = convert_module._QuantizedWeights.find
    quantize_for_screen = passes.quantize_for_screen
    spent, shared_bytes = [0.0], [0]

    def find(self, source, weight, how):
        found = original_find(self, source, weight, how)
        shared_bytes[0] += found.nbytes if found is not None else 0
        return found

    passes.quantize_for_screen = timed_into(spent, quantize_for_screen)
    print(f"{'size':>6} {'weights':>15} {'screen copies s':>15} {'analysis s':>10} {'shared MiB':>10}")
    for size in sizes:
        moe, _, batches = pair(size)
        _analysis_seconds(moe, batches, 0.0)  # one-time costs, not measured
        best: dict[str, tuple[float, float, int]] = {}
        for _ in range(ROUNDS[size] + 1):
            for way in ("quantized again", "shared"):
                convert_module._QuantizedWeights.find = find if way == "shared" else (lambda *args: None)
                spent[0], shared_bytes[0] = 0.0, 0
                seconds = _analysis_seconds(moe, batches, 0.0)[0]
                if way not in best or seconds < best[way][1]:
                    best[way] = (spent[0], seconds, shared_bytes[0])
        convert_module._QuantizedWeights.find = original_find
        for way, (screens, seconds, shared) in best.items():
            print(f"{size:>6} {way:>15} {screens:>15.3f} {seconds:>10.2f} {shared / 2**20:>10.1f}")
        print(f"{size:>6} analysis, quantized again / shared: {best['quantized again'][1] / best['shared'][1]:.3f}")
    passes.quantize_for_screen = quantize_for_screen
    print(f"peak RSS {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20:.2f} GiB")


def grouped_floor(sizes: list[str]) -> None:
    """The table of --grouped-floor."""
    import qcore.graph.capture as capture_module

    linearized = capture_module.linearized_experts

    @contextlib.contextmanager
    def left_grouped(model):
        yield {"layers": {}, "blocks": {}}

    print(f"{'size':>6} {'model':>32} {'items':>6} {'analysis / forward':>18} {'over dense':>10}  per round")
    for size in sizes:
        moe, dense, batches = pair(size)
        cases = (("dense", dense, linearized), ("MoE, experts per layer (today)", moe, linearized),
                 ("MoE, experts left grouped, float", moe, left_grouped))
        for _, model, capture_with in cases:  # one-time costs, not measured
            capture_module.linearized_experts = capture_with
            _analysis_seconds(model, batches, 0.0)
        rounds: dict[str, list[float]] = {}
        items: dict[str, int] = {}
        for _ in range(ROUNDS[size] // 2 + 1):
            for name, model, capture_with in cases:
                capture_module.linearized_experts = capture_with
                forward = steady_forward_seconds(model, batches)
                seconds, items[name], _, _ = _analysis_seconds(model, batches, 0.0)
                rounds.setdefault(name, []).append(seconds / forward)
        capture_module.linearized_experts = linearized
        dense_ratio = statistics.median(rounds["dense"])
        for name, ratios in rounds.items():
            print(f"{size:>6} {name:>32} {items[name]:>6} {statistics.median(ratios):>17.1f}x "
                  f"{statistics.median(ratios) / dense_ratio:>10.2f}  {', '.join(f'{r:.1f}' for r in ratios)}")


def grouped_sqnr_cost(sizes: list[str]) -> None:
    """The table of --grouped-sqnr."""
    import qcore
    from qcore.analysis import AnalysisPlan, ModelAnalysis, measure_sqnr
    from qcore.graph.capture import experts_grouped
    from qcore.report import (
        DynamicStaticDetector,
        ExpertCoverageDetector,
        InputWeightEqualizationDetector,
        OutlierDetector,
        PerChannelDetector,
    )

    def measured(model, batches, grouped: bool, detectors: bool) -> tuple[float, int]:
        start = time.perf_counter()
        with experts_grouped(grouped):
            gm = qcore.capture(model, batches[0])
        if not detectors:
            layers = len(measure_sqnr(gm, batches, qcore.Int8StaticQuantizer()).layers)
            return time.perf_counter() - start, layers
        plan = AnalysisPlan(measurements=frozenset({"sqnr", "detectors"}), detectors={
            "per_channel": PerChannelDetector(), "dynamic_static": DynamicStaticDetector(),
            "equalization": InputWeightEqualizationDetector(0.5), "outlier": OutlierDetector(),
            "expert_coverage": ExpertCoverageDetector()})
        analysis = ModelAnalysis(gm, qcore.Int8StaticQuantizer(), batches, plan=plan)
        layers = len(analysis.sqnr.layers)
        analysis.measurement  # noqa: B018 - the detectors' reports, measured in the same passes
        return time.perf_counter() - start, layers

    print(f"{'size':>6} {'measured':>17} {'model':>26} {'layers':>6} {'/ forward':>9} {'over dense':>10}  per round")
    for size in sizes:
        moe, dense, batches = pair(size)
        cases = (("dense", dense, False), ("MoE, one layer per expert", moe, False),
                 ("MoE, grouped projections", moe, True))
        for detectors in (False, True):
            for _, model, grouped in cases:  # one-time costs, not measured
                measured(model, batches, grouped, detectors)
        rounds: dict[tuple[bool, str], list[float]] = {}
        layers: dict[str, int] = {}
        for _ in range(ROUNDS[size]):
            for name, model, grouped in cases:
                forward = steady_forward_seconds(model, batches)
                for detectors in (False, True):
                    seconds, layers[name] = measured(model, batches, grouped, detectors)
                    rounds.setdefault((detectors, name), []).append(seconds / forward)
        for detectors in (False, True):
            dense_ratio = statistics.median(rounds[detectors, "dense"])
            for name, _, _ in cases:
                ratios = rounds[detectors, name]
                label = "sqnr, detectors" if detectors else "measure_sqnr"
                print(f"{size:>6} {label:>17} {name:>26} {layers[name]:>6} {statistics.median(ratios):>8.1f}x "
                      f"{statistics.median(ratios) / dense_ratio:>10.2f}  {', '.join(f'{r:.1f}' for r in ratios)}")
    print(f"peak RSS {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20:.2f} GiB")


def ops_table(sizes: list[str], checks: list[str] | None = None, rows: int = 24) -> None:
    """The table of --ops, then the grouped forms' check (grouped_forms_agree)."""
    from collections import Counter

    from torch.utils._python_dispatch import TorchDispatchMode

    from qcore.graph.inputs import call_model

    class CountedOps(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.counts: Counter[str] = Counter()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001 - torch's signature
            self.counts[str(func)] += 1
            return func(*args, **(kwargs or {}))

    print(f"quantizer: {QUANTIZER}; checks: {','.join(checks) if checks else 'every default check'}")
    for size in sizes:
        moe, dense, batches = pair(size)
        counted: dict[str, tuple[Counter[str], Counter[str]]] = {}
        for name, model in (("dense", dense), ("moe", moe)):
            _analysis_seconds(model, batches, 0.0, checks)  # its one-time work: not counted
            with CountedOps() as forward, torch.no_grad():
                for batch in batches:
                    call_model(model, batch)
            with CountedOps() as analysis:
                _analysis_seconds(model, batches, 0.0, checks)
            counted[name] = (forward.counts, analysis.counts)
            run, ran = sum(forward.counts.values()), sum(analysis.counts.values())
            print(f"{size:>7} {name:>5}: forward {run:,} ops, analysis {ran:,} ({ran / run:.1f} per forward op)")
        per_forward = {name: {op: count / sum(forward.values()) for op, count in analysis.items()}
                       for name, (forward, analysis) in counted.items()}
        ops = sorted(set(per_forward["dense"]) | set(per_forward["moe"]),
                     key=lambda op: per_forward["dense"].get(op, 0.0) - per_forward["moe"].get(op, 0.0))
        print(f"{'op':>40} {'dense':>8} {'moe':>8}   (analysis ops per forward op; counts)")
        for op in ops[:rows]:
            print(f"{op[:40]:>40} {per_forward['dense'].get(op, 0.0):>8.3f} {per_forward['moe'].get(op, 0.0):>8.3f}"
                  f"   ({counted['dense'][1][op]:,}, {counted['moe'][1][op]:,})")
    print(f"grouped forms agree bit for bit: {grouped_forms_agree()}")


def where_read_cost(rounds: int = 5) -> None:
    """--where-read: what one read of an expert weight quantized where read costs, over one projection of a
    30B-shaped block (128 experts' [768, 2048] float32 weights, 805 MB: each read comes from memory, as in an
    analysis): the path that made the native kernel's arguments at each read (fake_quantize_per_channel into a
    reused buffer), the read as convert builds it (fake_quantize_where_read: the arguments kept per qparams), one
    expert of the same weights held as a grouped projection's [128, 768, 2048] weight (ExpertsQuantizedWhereRead:
    every expert's arguments kept per qparams), and the kernel alone; alternating rounds, each figure the fastest
    round's mean over the weights."""
    from qcore.observe.qparams import KeptRowArguments, fake_quantize_per_channel
    from qcore.observe.segmented import fake_quantize_experts_where_read
    from qcore.quantization.convert import fake_quantize_where_read, quantize_weights_where_read
    from qcore.runtime import native

    generator = torch.Generator().manual_seed(0)
    grouped_weight = torch.randn(128, 768, 2048, generator=generator) * 0.02
    grouped_scale = grouped_weight.abs().amax(dim=2) / 127.5
    weights, scales = list(grouped_weight), list(grouped_scale)  # each expert's views
    zero_point = torch.zeros(768, dtype=torch.int64)
    grouped_zero_point = torch.zeros(128, 768, dtype=torch.int64)
    arguments = [KeptRowArguments().arguments(w, s, zero_point, 0, -128, 127) for w, s in zip(weights, scales)]
    library, out = native.kernel(), torch.empty(768, 2048)

    def each_argument_made(index: int) -> torch.Tensor:
        return fake_quantize_per_channel(weights[index], scales[index], zero_point, 0, -128, 127, reuse_output=True)

    def kept(index: int) -> torch.Tensor:
        return fake_quantize_where_read(weights[index], scales[index], zero_point, 0, -128, 127)

    def grouped_expert(index: int) -> torch.Tensor:  # made at each graph run, its experts read one by one
        return fake_quantize_experts_where_read(grouped_weight, grouped_scale, grouped_zero_point, -128,
                                                127).expert(index)

    def kernel_alone(index: int) -> None:
        inverse, steps, low, high = arguments[index]
        library.qcore_fake_quantize_per_row(weights[index].data_ptr(), out.data_ptr(), 768, 2048, inverse.data_ptr(),
                                            steps.data_ptr(), low.data_ptr(), high.data_ptr(),
                                            native.threads(out.numel()), native.streams(out.nbytes))

    paths = {"arguments made at each read": each_argument_made, "arguments kept (fake_quantize_where_read)": kept,
             "a grouped projection's expert, arguments kept": grouped_expert, "the kernel alone": kernel_alone}
    best = dict.fromkeys(paths, float("inf"))
    with torch.no_grad(), quantize_weights_where_read():
        for round_index in range(rounds + 1):  # the first warms the buffers and the kept arguments: not counted
            for name, read in paths.items():
                start = time.perf_counter()
                for index in range(len(weights)):
                    read(index)
                if round_index:
                    best[name] = min(best[name], (time.perf_counter() - start) / len(weights))
    for name, seconds in best.items():
        print(f"{name:>42}: {seconds * 1e6:7.1f} us a read")
    print(f"{'beside the kernel, made at each read / kept':>42}: "
          f"{(best['arguments made at each read'] - best['the kernel alone']) * 1e6:.1f} us / "
          f"{(best['arguments kept (fake_quantize_where_read)'] - best['the kernel alone']) * 1e6:.1f} us")
    grouped = best["a grouped projection's expert, arguments kept"]
    print(f"{'beside the kernel, a grouped expert':>42}: {(grouped - best['the kernel alone']) * 1e6:.1f} us")


def compare_sums_cost(rounds: int = 7) -> None:
    """--compare-sums: qcore_compare_sums (a comparator's update, a weight's SQNR) as qcore builds it, with its sums
    added as lane vectors, against the same source built with the scalar loop (-DQCORE_SCALAR_SUMS), both with
    qcore's compiler flags, at the sizes a 30B-shaped MoE's experts hand it (32 tokens of 768 and of 2048) and a
    dense layer's; each figure the fastest of `rounds` rounds, and the sums checked bit for bit."""
    import ctypes
    import shlex
    import subprocess
    import tempfile

    from qcore.runtime import native

    native.kernel()
    flags = [*native._FLAGS, *(("-march=native", "-fopenmp") if native._state.get("openmp") else ())]
    builds = {}
    with tempfile.TemporaryDirectory() as folder:
        for name, extra in (("scalar loop", ["-DQCORE_SCALAR_SUMS"]), ("lane vectors", [])):
            target = f"{folder}/{name.replace(' ', '_')}.so"
            subprocess.run([*shlex.split(os.environ.get("CC", "cc")), *flags, *extra, "-o", target,
                            *map(str, native._SOURCES), *native._LIBRARIES], check=True)
            library = ctypes.CDLL(target)
            library.qcore_compare_sums.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64,
                                                   ctypes.c_void_p]
            builds[name] = library
    generator = torch.Generator().manual_seed(0)
    print(f"flags: {' '.join(flags)}; torch threads {torch.get_num_threads()}")
    print(f"{'values':>9} {'threads':>7} {'scalar loop us':>14} {'lane vectors us':>15} {'ratio':>6}")
    for numel in (32 * 768, 32 * 2048, 512 * 6144):
        reference = torch.randn(numel, generator=generator)
        actual = reference + 0.01 * torch.randn(numel, generator=generator)
        for threads in sorted({1, native.threads(numel)}):
            sums = {name: torch.zeros(4, dtype=torch.float64) for name in builds}
            for name, library in builds.items():
                library.qcore_compare_sums(reference.data_ptr(), actual.data_ptr(), numel, threads,
                                           sums[name].data_ptr())
            assert torch.equal(sums["scalar loop"], sums["lane vectors"]), sums
            calls = max(20, 4_000_000 // numel)
            best = dict.fromkeys(builds, float("inf"))
            out = torch.zeros(4, dtype=torch.float64)
            for _ in range(rounds):  # alternating, so that the machine's drift falls on both
                for name, library in builds.items():
                    start = time.perf_counter()
                    for _ in range(calls):
                        library.qcore_compare_sums(reference.data_ptr(), actual.data_ptr(), numel, threads,
                                                   out.data_ptr())
                    best[name] = min(best[name], (time.perf_counter() - start) / calls)
            print(f"{numel:>9} {threads:>7} {best['scalar loop'] * 1e6:>14.1f} {best['lane vectors'] * 1e6:>15.1f} "
                  f"{best['lane vectors'] / best['scalar loop']:>5.2f}x")
    print("sums bit for bit equal: True")


def shadow_pairs_cost(rounds: int = 7) -> None:
    """--shadow-pairs: a layer's own shadow and a screen's shadow multiplying by one weight, as two matmuls and as
    qcore's linear_on_rows_together (one matmul over both inputs' rows where they are few and the weight large), at
    the rows a 30B-shaped MoE's expert gets a batch (32 on average) and around the size limit; each figure the
    fastest of `rounds` alternating rounds, over 16 weights read from memory in turn, and the largest difference
    between the two results."""
    from qcore.numeric.instrument import _FEW_ROWS, _LARGE_WEIGHT, linear_on_rows_together

    linear = torch.ops.aten.linear.default
    generator = torch.Generator().manual_seed(0)
    print(f"torch threads {torch.get_num_threads()}; together where rows <= {_FEW_ROWS} and the weight has "
          f">= {_LARGE_WEIGHT} elements")
    print(f"{'weight':>11} {'rows':>5} {'two matmuls us':>14} {'together us':>11} {'ratio':>6} {'max difference':>14}")
    for out_features, in_features in ((768, 2048), (2048, 768), (512, 1024), (128, 128)):
        weights = [torch.randn(out_features, in_features, generator=generator) for _ in range(16)]
        for rows in (8, 32, 64, 128, 256):
            first, second = (torch.randn(rows, in_features, generator=generator) for _ in range(2))
            ways = {"two": lambda w, a=first, b=second: (linear(a, w), linear(b, w)),
                    "together": lambda w, a=first, b=second: linear_on_rows_together(a, b, w)}
            difference = max(float((a - b).abs().max()) for a, b in zip(ways["two"](weights[0]),
                                                                        ways["together"](weights[0])))
            best = dict.fromkeys(ways, float("inf"))
            for _ in range(rounds):  # alternating, so that the machine's drift falls on both
                for name, way in ways.items():
                    start = time.perf_counter()
                    for weight in weights:
                        way(weight)
                    best[name] = min(best[name], (time.perf_counter() - start) / len(weights))
            print(f"{out_features:>5}x{in_features:<5} {rows:>5} {best['two'] * 1e6:>14.0f} "
                  f"{best['together'] * 1e6:>11.0f} {best['together'] / best['two']:>5.2f}x {difference:>14.2g}")


def _timed_analysis_of_each(models, batches, totals: dict[str, list[float]], each: dict[str, list]):
    """For each (label, model): a first analysis that pays its one-time costs, the steady forward, then one
    verdicts-only analysis with the timers' `totals` and `each` cleared before it; yields (label, forward seconds,
    analysis seconds)."""
    for label, model in models:
        _analysis_seconds(model, batches, 0.0)
        forward = steady_forward_seconds(model, batches)
        for name in totals:
            totals[name][0] = 0.0
            each[name].clear()
        yield label, forward, _analysis_seconds(model, batches, 0.0)[0]


def native_calls(size: str = "30b-a3b") -> None:
    """--native-calls: the time each of qcore's native kernels takes in one verdicts-only analysis of --cost's two
    models at `size` (every default check; each model's first analysis warms its one-time costs and is not counted),
    against each model's forward: calls, median call and total."""
    from qcore.runtime import native

    moe, dense, batches = pair(size)
    library = native.kernel()
    kernels = {name: getattr(library, name) for name in dir(library)
               if name.startswith("qcore_") and name != "qcore_usable_threads"}
    totals: dict[str, list[float]] = {name: [0.0] for name in kernels}
    each: dict[str, list[tuple[str, float]]] = {name: [] for name in kernels}  # (graph code, seconds) a call
    try:
        for name, function in kernels.items():
            setattr(library, name, timed_into(totals[name], function, each=each[name]))
        for label, forward, seconds in _timed_analysis_of_each((("dense", dense), ("moe", moe)), batches, totals,
                                                               each):
            native_seconds = sum(total[0] for total in totals.values())
            print(f"{label}: forward {forward:.2f} s, analysis {seconds:.1f} s ({seconds / forward:.1f}x), native "
                  f"kernels {native_seconds:.2f} s ({native_seconds / forward:.2f}x)")
            for name in sorted((name for name in kernels if each[name]), key=lambda name: -totals[name][0]):
                median = statistics.median(took for _, took in each[name])
                print(f"  {name:>34} {len(each[name]):>7} calls, median {median * 1e6:8.1f} us, "
                      f"{totals[name][0]:6.2f} s, {totals[name][0] / forward:.2f}x its forward")
    finally:
        for name, function in kernels.items():
            setattr(library, name, function)


# (module, attribute) of the functions --functions times; several run inside others (the comparison pass's graph
# runs inside compare_propagated_and_shadow, inside measure_model), so the figures overlap
TIMED_FUNCTIONS = (
    ("qcore.measure.passes", "measure_model"), ("qcore.numeric.compare", "compare_propagated_and_shadow"),
    ("qcore.numeric.compare", "run_both"), ("qcore.quantization.calibrate", "calibrate"),
    ("qcore.measure.passes", "ProbedModel.read"), ("qcore.measure.variants", "plan_variants"),
    ("qcore.measure.passes", "_screen_copies"), ("qcore.measure.screens", "quantize_for_screen"),
    ("torch.fx.graph_module", "GraphModule.recompile"), ("qcore.quantization.convert", "convert"),
    ("qcore.measure.passes", "ProbedModel.__init__"), ("qcore.quantization.prepare", "prepare"),
    ("qcore.measure.variants", "add_variant_shadow"), ("qcore.measure.passes", "weight_sqnrs"),
    ("qcore.numeric.compare", "_remove_nodes_since"), ("qcore.numeric.compare", "_add_extra_shadows"),
)


def function_times(size: str = "30b-a3b") -> None:
    """--functions: the seconds a few of qcore's functions take in one verdicts-only analysis of each of --cost's
    two models at `size` (each model's first analysis warms its one-time costs and is not counted), against each
    model's forward: the comparison pass's graph runs, calibration, and the graph building around them. A function
    is timed where it is defined and wherever a module imported it by name; a call inside a call of itself counts
    once."""
    import importlib

    moe, dense, batches = pair(size)
    totals: dict[str, list[float]] = {}
    calls: dict[str, list] = {}  # each timed call's (graph code, seconds)
    restore: list[tuple[Any, str, Any]] = []

    try:
        for module_name, attribute in TIMED_FUNCTIONS:
            owner = importlib.import_module(module_name)
            *path, name = attribute.split(".")
            for part in path:
                owner = getattr(owner, part)
            function = getattr(owner, name)
            label = f"{module_name.rsplit('.', 1)[-1]}.{attribute}"
            totals[label], calls[label] = [0.0], []
            timed = timed_into(totals[label], function, each=calls[label], outermost=True)
            holders = [owner, *(module for module in list(sys.modules.values()) if module is not None
                                and module is not owner and getattr(module, name, None) is function)]
            for holder in holders:
                restore.append((holder, name, function))
                setattr(holder, name, timed)
        for label, forward, seconds in _timed_analysis_of_each((("dense", dense), ("moe", moe)), batches, totals,
                                                               calls):
            print(f"{label}: forward {forward:.2f} s, analysis {seconds:.1f} s ({seconds / forward:.2f}x)")
            for name in sorted(totals, key=lambda name: -totals[name][0]):
                print(f"  {name:>48} {len(calls[name]):>6} calls {totals[name][0]:7.2f} s "
                      f"{totals[name][0] / forward:6.3f}x its forward")
    finally:
        for holder, name, function in reversed(restore):
            setattr(holder, name, function)


def where_read_trace(size: str = "30b-a3b") -> None:
    """--where-read-trace: each weight quantized where read in one verdicts-only analysis of --cost's MoE at `size`
    (every default check), timed apart and grouped by graph run in the order they ran: the graph's code (the float
    graph with its shadows, the quantized graph, the float graph once its first batches' instruments are gone), the
    reads of that run, their median and their tenth and ninetieth percentiles. Then the same kernel over the model's
    own first block's gate weights in a loop apart from an analysis, in the same process, and the quotient of the
    medians. OMP_WAIT_POLICY, as the environment sets it, is printed: the read's time inside an analysis depends on
    it."""
    from qcore.quantization.convert import fake_quantize_where_read, quantize_weights_where_read

    def quantiles(seconds: list[float]) -> tuple[float, float, float]:
        ordered = sorted(seconds)
        return tuple(ordered[int(q * (len(ordered) - 1))] * 1e6 for q in (0.1, 0.5, 0.9))

    moe, _, batches = pair(size)
    print(f"OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY', '(not set)')}; torch threads "
          f"{torch.get_num_threads()}; {size}, verdicts only")
    _analysis_seconds(moe, batches, 0.0)  # one-time costs, not traced
    reads: list[tuple[str, float]] = []  # (the graph code that read the weight, seconds)
    seconds = _analysis_seconds(moe, batches, 0.0, reads=reads)[0]
    graphs: dict[str, str] = {}
    runs: list[tuple[str, list[float]]] = []
    for graph, read_seconds in reads:
        label = graphs.setdefault(graph, f"graph {len(graphs) + 1}")
        if not runs or runs[-1][0] != label:
            runs.append((label, []))
        runs[-1][1].append(read_seconds)
    print(f"analysis {seconds:.1f} s; {len(reads)} reads, {sum(s for _, s in reads):.2f} s")
    print(f"{'run':>4} {'graph':>8} {'reads':>6} {'p10 us':>7} {'median us':>9} {'p90 us':>7}")
    for index, (label, read_seconds) in enumerate(runs):
        low, middle, high = quantiles(read_seconds)
        print(f"{index + 1:>4} {label:>8} {len(read_seconds):>6} {low:>7.0f} {middle:>9.0f} {high:>7.0f}")
    experts = moe.model.layers[0].mlp.experts
    rows = experts.gate_up_proj.shape[1] // 2
    weights = [experts.gate_up_proj[expert, :rows].detach() for expert in range(experts.gate_up_proj.shape[0])]
    scale = torch.stack([w.abs().amax(dim=1) for w in weights]).amax(dim=0) / 127.5
    zero_point = torch.zeros(rows, dtype=torch.int64)
    apart: list[float] = []
    with torch.no_grad(), quantize_weights_where_read():
        for round_index in range(6):  # the first warms the buffer and the kept arguments: not counted
            for weight in weights:
                started = time.perf_counter()
                fake_quantize_where_read(weight, scale, zero_point, 0, -128, 127)
                if round_index:
                    apart.append(time.perf_counter() - started)
    low, middle, high = quantiles(apart)
    inside = quantiles([s for _, s in reads])[1]
    print(f"apart from an analysis, {len(apart)} reads of the first block's gate weights: p10 {low:.0f} us, median "
          f"{middle:.0f} us, p90 {high:.0f} us; the analysis's median over it: {inside / middle:.2f}x")


def where_read_stores(seconds: float = 60.0, threads: int | None = None) -> None:
    """--where-read-stores: each of 128 expert weights ([768, 2048] float32) quantized where read into its reused
    buffer and read by its matmul over 32 tokens, with the per-row kernel's plain stores and its streaming stores
    alternately, for `seconds`: per 2-second window, the medians of the read and of the matmul after it, for each.
    `threads`: torch's threads for the run (streaming forced on even with one, where the plugin keeps plain stores)."""
    from qcore.quantization.convert import fake_quantize_where_read, quantize_weights_where_read
    from qcore.runtime import native, scratch

    generator = torch.Generator().manual_seed(0)
    grouped_weight = torch.randn(128, 768, 2048, generator=generator) * 0.02
    scale = grouped_weight.abs().amax(dim=2).amax(dim=0) / 127.5
    zero_point = torch.zeros(768, dtype=torch.int64)
    tokens = torch.randn(32, 2048, generator=generator)
    if threads is not None:
        torch.set_num_threads(threads)
    stores = {"plain": 0, "streaming": 1}  # what native.streams answers for each
    kept = native.streams
    print(f"torch threads {torch.get_num_threads()}; {native.status()}; read + matmul medians per 2 s window, us")
    print(f"{'s':>4} " + " ".join(f"{name + ' read':>15} {name + ' matmul':>15}" for name in stores))
    totals: dict[str, list[float]] = {name: [] for name in stores}
    started = time.perf_counter()
    try:
        with torch.no_grad(), quantize_weights_where_read(), scratch.reused_outputs():
            while time.perf_counter() - started < seconds:
                window = time.perf_counter()
                reads = {name: ([], []) for name in stores}
                while time.perf_counter() - window < 2.0:
                    for weight in grouped_weight:
                        for name, streaming in stores.items():
                            native.streams = lambda nbytes, streaming=streaming: streaming
                            start = time.perf_counter()
                            quantized = fake_quantize_where_read(weight, scale, zero_point, 0, -128, 127)
                            middle = time.perf_counter()
                            torch.nn.functional.linear(tokens, quantized)
                            reads[name][0].append(middle - start)
                            reads[name][1].append(time.perf_counter() - middle)
                            del quantized
                medians = {name: (statistics.median(read), statistics.median(matmul))
                           for name, (read, matmul) in reads.items()}
                for name, (read, matmul) in medians.items():
                    totals[name].append(read + matmul)
                print(f"{time.perf_counter() - started:>4.0f} " + " ".join(
                    f"{read * 1e6:>15.0f} {matmul * 1e6:>15.0f}" for read, matmul in medians.values()), flush=True)
    finally:
        native.streams = kept
    plain, streaming = (statistics.median(totals[name]) for name in stores)
    print(f"read + matmul, median window: plain {plain * 1e6:.0f} us, streaming {streaming * 1e6:.0f} us "
          f"(streaming/plain {streaming / plain:.2f}x)")


def grouped_forms_agree() -> dict[str, bool]:
    """Whether torch's grouped_mm gives one linear per expert's values (float32 and bfloat16, an expert with no
    token included), and one fake quantization per row with each row's expert's int8 qparams gives one per-tensor
    fake quantization per expert's (qcore's kernels), to the bit."""
    from qcore.observe.qparams import fake_quantize_per_channel, fake_quantize_per_tensor

    generator = torch.Generator().manual_seed(0)
    counts = [5, 0, 17, 3, 40, 1, 9, 13]
    inputs = torch.randn(sum(counts), 128, generator=generator)
    weights = torch.randn(len(counts), 256, 128, generator=generator)  # [expert, out, in], as nn.Linear's
    ends = torch.tensor(counts).cumsum(0).to(torch.int32)
    agree = {}
    for dtype in (torch.float32, torch.bfloat16):
        x, w = inputs.to(dtype), weights.to(dtype)
        grouped = torch.nn.functional.grouped_mm(x, w.transpose(-2, -1), offs=ends)
        each = torch.cat([torch.nn.functional.linear(part, w[e]) for e, part in enumerate(x.split(counts))])
        agree[f"grouped_mm {dtype}"] = torch.equal(grouped, each)
    scales = torch.rand(len(counts), generator=generator) * 0.05 + 0.001
    zero_points = torch.randint(-20, 20, (len(counts),), generator=generator)
    rows = torch.repeat_interleave(torch.arange(len(counts)), torch.tensor(counts))
    per_row = fake_quantize_per_channel(inputs * 3, scales[rows], zero_points[rows], 0, -128, 127)
    per_expert = torch.cat([fake_quantize_per_tensor(part, float(scales[e]), int(zero_points[e]), -128, 127)
                            for e, part in enumerate((inputs * 3).split(counts))])
    agree["per-row int8 fake quantization"] = torch.equal(per_row, per_expert)
    return agree


def main() -> None:
    if "--peak-of" in sys.argv:  # one form's analysis, in a subprocess of --peak
        at = sys.argv.index("--peak-of")
        peak_of_one(sys.argv[at + 1], sys.argv[at + 2])
        return
    if "--peak" in sys.argv:
        peak_memory(sys.argv[sys.argv.index("--sizes") + 1].split(",") if "--sizes" in sys.argv else ["small"])
        return
    if "--ops" in sys.argv:
        ops_table(sys.argv[sys.argv.index("--sizes") + 1].split(",") if "--sizes" in sys.argv else ["tiny"],
                  sys.argv[sys.argv.index("--checks") + 1].split(",") if "--checks" in sys.argv else None)
        return
    if "--grouped-sqnr" in sys.argv:
        grouped_sqnr_cost(sys.argv[sys.argv.index("--sizes") + 1].split(",") if "--sizes" in sys.argv
                          else ["tiny", "small"])
        return
    if "--grouped-floor" in sys.argv:
        grouped_floor(sys.argv[sys.argv.index("--sizes") + 1].split(",") if "--sizes" in sys.argv
                      else ["tiny", "small"])
        return
    if "--shared-weights" in sys.argv:
        shared_weights_cost(sys.argv[sys.argv.index("--sizes") + 1].split(",") if "--sizes" in sys.argv
                            else ["tiny", "small"])
        return
    if "--capture" in sys.argv:
        capture_cost()
        return
    if "--where-read-stores" in sys.argv:
        where_read_stores(float(sys.argv[sys.argv.index("--seconds") + 1]) if "--seconds" in sys.argv else 60.0,
                          int(sys.argv[sys.argv.index("--threads") + 1]) if "--threads" in sys.argv else None)
        return
    if "--where-read-trace" in sys.argv:
        where_read_trace(sys.argv[sys.argv.index("--sizes") + 1] if "--sizes" in sys.argv else "30b-a3b")
        return
    if "--where-read" in sys.argv:
        where_read_cost()
        return
    if "--compare-sums" in sys.argv:
        compare_sums_cost()
        return
    if "--shadow-pairs" in sys.argv:
        shadow_pairs_cost()
        return
    if "--functions" in sys.argv:
        function_times(sys.argv[sys.argv.index("--sizes") + 1] if "--sizes" in sys.argv else "30b-a3b")
        return
    if "--native-calls" in sys.argv:
        native_calls(sys.argv[sys.argv.index("--sizes") + 1] if "--sizes" in sys.argv else "30b-a3b")
        return
    if "--experts" in sys.argv:
        experts_cost([int(count) for count in sys.argv[sys.argv.index("--experts") + 1].split(",")])
        return
    if "--device" in sys.argv:
        global DEVICE
        DEVICE = sys.argv[sys.argv.index("--device") + 1]
        if DEVICE != "cpu":
            print(f"device: {torch.cuda.get_device_name(DEVICE)}, torch {torch.__version__}")
    if "--quantizer" in sys.argv:
        global QUANTIZER
        QUANTIZER = sys.argv[sys.argv.index("--quantizer") + 1]
    if "--rounds" in sys.argv:  # more rounds for a tighter median where the machine's speed moves
        ROUNDS.update(dict.fromkeys(ROUNDS, int(sys.argv[sys.argv.index("--rounds") + 1])))
    if "--cost" in sys.argv:
        sizes = sys.argv[sys.argv.index("--sizes") + 1].split(",") if "--sizes" in sys.argv else ["tiny", "small"]
        cost(sizes, sys.argv[sys.argv.index("--checks") + 1].split(",") if "--checks" in sys.argv else None,
             int(sys.argv[sys.argv.index("--tokens") + 1]) if "--tokens" in sys.argv else None,
             per_expert="--per-expert" in sys.argv)
        return
    tokens = routed_tokens()
    usable = {e: t for e, t in tokens.items() if len(t) >= 2 * COUNTS[-1]}
    print(f"tokens per expert: {[len(t) for t in tokens.values()]}; experts with {2 * COUNTS[-1]}+: {len(usable)}")
    full = {e: held_out_sqnr(t, len(t) // 2) for e, t in usable.items()}
    print(f"{'tokens':>7} {'median loss dB':>15} {'worst loss dB':>14}")
    for count in COUNTS:
        losses = [full[e] - held_out_sqnr(t, count) for e, t in usable.items()]
        print(f"{count:>7} {statistics.median(losses):>15.2f} {max(losses):>14.2f}")


if __name__ == "__main__":
    main()
