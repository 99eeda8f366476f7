"""Output-level gates: kl_divergence, top1_agreement, perplexity and task_metric, checked against direct
computations on qcore's own float and quantized graphs, and end to end through every report and baselines."""
import json
import math
import re
import xml.etree.ElementTree as ET

import pytest
import torch
import torchao  # noqa: F401 - imported once here: pytester runs in process and must not import it again
from torch import nn

import qcore
from qcore.analysis import AnalysisPlan, ModelAnalysis
from qcore.graph.inputs import call_model
from qcore.numeric.logits import LogitsComparator, logits_leaf
from tests.helpers import analyze_with_checks
from tests.models import tiny_llama

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def llama():
    return tiny_llama(layers=2, batch=4)


def _direct(float_gm, quant_gm, batches):
    """KL, top-1 agreement and both perplexities computed plainly, batch by batch."""
    kl, agree, positions, nll, tokens = 0.0, 0, 0, [0.0, 0.0], 0
    with torch.no_grad():
        for batch in batches:
            p = torch.log_softmax(call_model(float_gm, batch)["logits"].double(), -1)
            q = torch.log_softmax(call_model(quant_gm, batch)["logits"].double(), -1)
            kl += float((p.exp() * (p - q)).sum())
            agree += int((p.argmax(-1) == q.argmax(-1)).sum())
            positions += p.shape[0] * p.shape[1]
            keep = batch["attention_mask"][:, 1:].bool()
            targets = batch["input_ids"][:, 1:]
            for index, logs in enumerate((p, q)):
                nll[index] += float(-logs[:, :-1].gather(-1, targets.unsqueeze(-1))[..., 0][keep].sum())
            tokens += int(keep.sum())
    return kl / positions, agree / positions, math.exp(nll[0] / tokens), math.exp(nll[1] / tokens)


def test_llama_output_gates_equal_a_direct_computation(llama):
    model, batches = llama
    found, analysis = analyze_with_checks(lambda: model, batches,
                                          checks=["kl_divergence", "top1_agreement", "perplexity"])
    kl, agreement, float_ppl, quant_ppl = _direct(analysis.float_gm, analysis.quantized_gm, batches)
    assert found[("kl_divergence", "output")].value == pytest.approx(kl, rel=0.02)
    assert abs(found[("top1_agreement", "output")].value - agreement) <= 0.01
    perplexity = found[("perplexity", "output")]
    assert perplexity.details["float_perplexity"] == pytest.approx(float_ppl, rel=1e-4)
    assert perplexity.details["quantized_perplexity"] == pytest.approx(quant_ppl, rel=1e-4)
    assert perplexity.value == pytest.approx(100 * (quant_ppl / float_ppl - 1), abs=1e-3)
    assert perplexity.details["tokens"] == 3 * 4 * 11  # the attention mask's next-token targets
    assert {f.verdict for f in found.values()} == {"pass"}
    assert found[("kl_divergence", "output")].details["leaf"] == "['logits']"


def test_the_comparison_pass_measures_the_logits_without_another_forward(llama, monkeypatch):
    model, batches = llama
    plan = AnalysisPlan(measurements=frozenset({"sqnr", "logits"}))  # what the output checks' needs ask for
    analysis = ModelAnalysis(qcore.capture(model, batches[0]), qcore.Int8StaticQuantizer(), batches, plan=plan)
    runs = []
    original = LogitsComparator.update
    monkeypatch.setattr(LogitsComparator, "update", lambda self, *a: (runs.append(1), original(self, *a))[1])
    analysis.sqnr  # noqa: B018 - the one comparison pass
    assert len(runs) == len(batches) and analysis.logits.positions == 3 * 4 * 16
    assert "quantized_gm" not in vars(analysis)  # no standalone quantized model was built for it
    # without "logits" in the plan the comparison pass skips them (trials, sqnr-only runs)
    runs.clear()
    ModelAnalysis(analysis.float_gm, qcore.Int8StaticQuantizer(), batches).sqnr  # noqa: B018
    assert not runs


class Regression(nn.Module):
    def __init__(self):
        super().__init__()
        self.body, self.head = nn.Linear(8, 16), nn.Linear(16, 1)

    def forward(self, x):
        return self.head(torch.relu(self.body(x)))


class Embedder(nn.Module):
    def __init__(self):
        super().__init__()
        self.body, self.norm = nn.Linear(8, 16), nn.LayerNorm(16)

    def forward(self, x):
        return self.norm(self.body(x))


@pytest.mark.parametrize("factory,why", [
    (Regression, "its output has shape (16, 1): a regression head or a score, not logits over classes"),
    (Embedder, "its output is not produced by a linear layer (a classification or LM head), nor named logits"),
])
def test_an_output_that_is_not_logits_skips_with_the_reason(factory, why):
    torch.manual_seed(0)
    batches = [torch.randn(16, 8) for _ in range(2)]
    found, _ = analyze_with_checks(lambda: factory().eval(), batches,
                                   checks=["kl_divergence", "top1_agreement", "perplexity"])
    for check in ("kl_divergence", "top1_agreement", "perplexity"):
        finding = found[(check, "output")]
        assert finding.verdict == "skip" and why in finding.message, finding.message


def test_logits_are_found_by_name_or_by_their_linear_head():
    torch.manual_seed(0)
    head = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 5)).eval()
    x = torch.randn(4, 8)
    gm = qcore.capture(head, x)
    assert logits_leaf(gm, gm(x))[:2] == (0, "output")
    assert logits_leaf(gm, {"hidden": torch.randn(4, 3), "logits": torch.randn(4, 5)})[:2] == (1, "['logits']")
    index, _, why = logits_leaf(gm, (torch.randn(4, 3), torch.randn(4, 5)))
    assert index is None and "none is named logits" in why


COMMON = '''
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from pytest_qreport import QReportAssertionError, qmodel

RULE = torch.randn(8, 4, generator=torch.Generator().manual_seed(7))


class TinyLM(nn.Module):
    def __init__(self, vocab=64, dim=32):
        super().__init__()
        self.embed, self.mix, self.head = nn.Embedding(vocab, dim), nn.Linear(dim, dim), nn.Linear(dim, vocab)

    def forward(self, input_ids, attention_mask=None):
        return {"logits": self.head(torch.relu(self.mix(self.embed(input_ids))))}


def confident_lm():
    """Predicts each token's own id by a wide margin (the head is the embedding): random logits are near ties
    that any noise reorders."""
    torch.manual_seed(0)
    model = TinyLM().eval()
    with torch.no_grad():
        model.mix.weight.copy_(torch.eye(32))
        model.mix.bias.zero_()
        model.head.weight.copy_(model.embed.weight)
    return model


def trained_classifier():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 4))
    x = torch.randn(512, 8, generator=torch.Generator().manual_seed(1))
    y = (x @ RULE).argmax(-1)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.05)
    for _ in range(60):
        optimizer.zero_grad()
        F.cross_entropy(model(x), y).backward()
        optimizer.step()
    return model.eval()


def accuracy(model, batches):
    """The share of rows whose class the model gets right."""
    right = sum(int((model(x).argmax(-1) == (x @ RULE).argmax(-1)).sum()) for x in batches)
    return right / sum(len(x) for x in batches)


@pytest.fixture
def tokens():
    g = torch.Generator().manual_seed(2)
    return [{"input_ids": torch.randint(0, 64, (4, 12), generator=g)} for _ in range(3)]


@pytest.fixture
def features():
    g = torch.Generator().manual_seed(3)
    return [torch.randn(64, 8, generator=g) for _ in range(3)]


@pytest.fixture
def held_out():
    g = torch.Generator().manual_seed(4)
    return [torch.randn(128, 8, generator=g) for _ in range(2)]
'''

PROJECT = COMMON + '''

@qmodel(calibration="tokens", checks="kl_divergence,top1_agreement,perplexity")
def lm():
    torch.manual_seed(0)
    return confident_lm()


@qmodel(calibration="features", eval_batches="held_out", task_metric=accuracy, task_recovery_min=0.95,
        checks="kl_divergence,top1_agreement,perplexity,task_metric")
def classifier():
    return trained_classifier()
'''


def _rows(path):
    return {(r["model"], r["check"], r["layer"]): r for r in json.loads(path.read_text())["rows"]}


@pytest.mark.parametrize("workers", [[], ["-n", "2"]])
def test_perplexity_and_task_metric_reach_every_report_and_round_trip_through_baselines(pytester, workers):
    pytester.makeconftest(PROJECT)
    outputs = ["--junitxml=pytest.xml", "--qreport-junitxml=qreport.xml", "--qreport-json=report.json",
               "--qreport-html=report.html", "--qreport-table=all"]
    result = pytester.runpytest("--qreport", "-p", "no:cacheprovider", *workers, *outputs)
    result.assert_outcomes(passed=6, skipped=1)  # the classifier's perplexity: it is no causal LM
    rows = _rows(pytester.path / "report.json")
    perplexity, task = rows[("lm", "perplexity", "output")], rows[("classifier", "task_metric", "output")]
    assert perplexity["metric"] == "perplexity_increase_pct" and 0 <= perplexity["value"] < 5
    assert perplexity["details"]["tokens"] == 3 * 4 * 11
    assert task["metric"] == "recovery" and task["value"] == pytest.approx(
        task["details"]["quantized"] / task["details"]["float"])
    assert task["details"]["float"] > 0.8 and task["details"]["metric"] == "accuracy"
    skipped = rows[("classifier", "perplexity", "output")]
    assert skipped["verdict"] == "skip" and "needs a causal LM" in skipped["message"]
    summary = result.stdout.str()
    assert re.search(r"lm\s+perplexity\s+output\s+\d\.\d\d%\s+5\.00%\s+PASS", summary)
    assert re.search(r"classifier\s+task_metric\s+output\s+[\d.]+\s+0\.95\s+PASS", summary)
    for name in ("pytest.xml", "qreport.xml"):
        names = {case.get("name") for case in ET.parse(pytester.path / name).iter("testcase")}
        assert any("perplexity" in n for n in names) and any("task_metric" in n for n in names), names
    html = (pytester.path / "report.html").read_text()
    assert "perplexity" in html and "task_metric" in html
    if workers:  # baselines round-trip under xdist in test_baseline; each -n 2 run here starts two workers
        return
    pytester.runpytest("--qreport", "-p", "no:cacheprovider", "--qreport-update-baseline", *workers)
    stored = json.loads((pytester.path / "__qreport__" / "classifier.json").read_text())
    assert "evaluation" in stored["fingerprint"]  # the eval batches are part of what the numbers depend on
    again = pytester.runpytest("--qreport", "-p", "no:cacheprovider", *workers, "--qreport-json=again.json",
                               "--qreport-baseline-strict")
    again.assert_outcomes(passed=8, skipped=1)  # with each model's baseline item
    compared = _rows(pytester.path / "again.json")
    for key in (("lm", "perplexity", "output"), ("classifier", "task_metric", "output"),
                ("classifier", "kl_divergence", "output"), ("classifier", "top1_agreement", "output")):
        assert compared[key]["baseline_status"] == "ok" and abs(compared[key]["delta"]) <= 0.005, compared[key]


def test_a_task_recovery_below_its_minimum_fails_with_both_raw_values(pytester):
    pytester.makeconftest(PROJECT.replace("task_recovery_min=0.95", "task_recovery_min=1.0"))
    result = pytester.runpytest("--qreport", "-p", "no:cacheprovider", "-k", "classifier and task_metric")
    rows = result.stdout.str()
    if "1 failed" in rows:  # int8 changed at least one answer of the held-out rows
        result.stdout.fnmatch_lines(["*model 'classifier': task_metric accuracy 0.* (float) -> 0.* (quantized) on "
                                     "the eval_batches: recovery *% < 100.00%*"])
    else:
        result.assert_outcomes(passed=1)


FIXTURE_TEST = COMMON + '''


def test_gates_from_the_fixture(qreport, features, held_out, tokens):
    result = qreport.analyze(trained_classifier(), features, eval_batches=held_out, task_metric=accuracy)
    result.assert_kl(0.05)
    result.assert_top1_agreement(0.9)
    result.assert_task_recovery(0.95)
    with pytest.raises(QReportAssertionError, match="output KL above 0 nats"):
        result.assert_kl(0.0)
    with pytest.raises(QReportAssertionError, match="needs a causal LM"):
        result.assert_perplexity_increase(5.0)
    lm = qreport.analyze(confident_lm(), tokens, name="lm")
    lm.assert_perplexity_increase(5.0)
    with pytest.raises(QReportAssertionError, match="assert_task_recovery needs"):
        lm.assert_task_recovery(0.9)
'''


def test_output_gates_work_from_the_qreport_fixture(pytester):
    pytester.makepyfile(test_gates=FIXTURE_TEST)
    result = pytester.runpytest("-p", "no:cacheprovider")
    result.assert_outcomes(passed=1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_logits_are_compared_a_bounded_number_of_positions_at_a_time(monkeypatch, dtype):
    """An LM's logits (2 x 64 x 32,000 on the 0.5B Llama) are compared a few positions at a time: the same KL,
    agreement and perplexities as all at once, with the attention mask's targets and an -inf logit."""
    from qcore.numeric import logits as logits_module

    g = torch.Generator().manual_seed(3)
    reference = torch.randn(3, 9, 17, generator=g)
    reference[0, 2, 5] = -math.inf
    actual = reference + 0.3 * torch.randn(3, 9, 17, generator=g)
    reference, actual = reference.to(dtype), actual.to(dtype)
    mask = torch.ones(3, 9, dtype=torch.long)
    mask[1, 6:] = 0
    batch = {"input_ids": torch.randint(0, 17, (3, 9), generator=g), "attention_mask": mask}
    results = []
    for positions in (10 ** 6, 17 * 4):  # all at once, then 4 positions at a time (7 parts)
        monkeypatch.setattr(logits_module, "_POSITIONS_ELEMENTS", positions)
        comparator = LogitsComparator()
        comparator.index = 0
        comparator.update([reference], [actual], batch)
        comparator.update([reference], [actual], batch)
        results.append(comparator.result())
    whole, parts = results
    assert parts.positions == whole.positions == 2 * 27 and parts.tokens == whole.tokens == 2 * (3 * 8 - 3)
    assert parts.top1_agreement == whole.top1_agreement and math.isfinite(whole.kl_nats)  # -inf adds 0, not nan
    for name in ("kl_nats", "float_perplexity", "quantized_perplexity"):
        assert getattr(parts, name) == pytest.approx(getattr(whole, name), rel=1e-6)
    log_p = torch.log_softmax(reference.float(), -1)
    nll = -log_p[:, :-1].gather(-1, batch["input_ids"][:, 1:, None])[..., 0][mask[:, 1:] != 0]
    assert whole.float_perplexity == pytest.approx(math.exp(float(nll.double().mean())), rel=1e-6)
