"""The `qreport` fixture: the same analysis as the items, inside a user's own test, fed by any fixture.

torch and qcore are imported only when `qreport.analyze(...)` is called.
"""
from __future__ import annotations

import fnmatch
import math
import os
from collections.abc import Iterable
from typing import Any

import pytest
from tabulate import tabulate

from ..core.baseline import baseline_path, write_baseline
from ..core.batches import as_batches, resolve_model, resolve_source
from ..core.declare import ModelDeclaration, model_name_problem
from ..core.errors import QReportAssertionError
from ..core.findings import Finding
from ..core.nodeids import item_name
from ..core.numbers import format_delta, format_value
from ..core.registry import CheckRegistry
from ..core.results import ModelFacts

__all__ = ["FIXTURE_RESULTS", "QReport", "QReportResult", "qreport"]

FIXTURE_RESULTS: pytest.StashKey[list[QReportResult]] = pytest.StashKey()


def _raise_assertion(message: str) -> None:
    __tracebackhide__ = True  # pytest shows the failing line of the user's test, then this message
    raise QReportAssertionError(message)


class QReportResult:
    """The findings of one `qreport.analyze(...)` call, with assertions that explain their failures."""

    def __init__(self, state: Any, findings: list[Finding], options: dict[str, Any], nodeid: str) -> None:
        self._state, self._options, self._nodeid = state, options, nodeid
        self.name: str = state.name
        self.findings: list[Finding] = [f.replace(nodeid=nodeid) for f in findings]
        self.baseline_path: str = state.baseline_path

    @property
    def analysis(self) -> Any:
        """The qcore ModelAnalysis behind the findings."""
        return self._state.context.analysis

    @property
    def fingerprint(self) -> dict[str, Any]:
        """What the numbers depend on (versions, quantizer, calibration digest, equalization, threads)."""
        return dict(self._state.fingerprint or {})

    @property
    def model_sqnr_db(self) -> float:
        """SQNR of the model's output in dB (the worst output leaf)."""
        worst = self.analysis.sqnr.worst_output()
        return math.nan if worst is None else worst.sqnr_db

    def layer(self, name: str) -> dict[str, Finding]:
        """{check: finding} of one layer."""
        found = {f.check: f for f in self.findings if f.layer == name}
        if not found:
            layers = sorted({f.layer for f in self.findings})
            raise KeyError(f"model {self.name!r} has no findings for layer {name!r}; layers: {layers}")
        return found

    def table(self, rows: Iterable[Finding] | None = None) -> str:
        """The findings (or `rows`) as a text table."""
        shown = list(self.findings if rows is None else rows)
        body = [[f.check, f.layer, format_value(f.value, f.metric), format_value(f.threshold, f.metric),
                 format_value(f.baseline, f.metric), format_delta(f.delta, f.metric), f.verdict.upper()]
                for f in shown]
        return tabulate(body, headers=["check", "layer", "value", "threshold", "baseline", "delta", "verdict"],
                        disable_numparse=True)

    def _fail(self, title: str, offending: list[Finding], worst_first: bool = True) -> None:
        __tracebackhide__ = True
        if worst_first:
            checks = self._state.context.checks

            def badness(f: Finding) -> float:
                if math.isnan(f.value):
                    return math.inf
                return -f.value if f.check not in checks or checks[f.check].higher_is_better else f.value

            offending = sorted(offending, key=badness, reverse=True)
        hints = "\n".join(f"- {f.check}/{f.layer}: {f.message}" for f in offending if f.message)
        _raise_assertion(f"{title}\n{self.table(offending)}" + (f"\n{hints}" if hints else ""))

    def assert_sqnr(self, min_db: float, layers: str = "*") -> None:
        """Every quantized layer matching the glob `layers` has a propagated SQNR of at least `min_db`; a glob that
        names an MoE projection's item (`model.layers.3.mlp.experts.down_proj`) names its experts' layers."""
        __tracebackhide__ = True
        from ..checks.sqnr import SqnrCheck, own_error_layers
        from ..core.experts import expert_item_names, expert_layers_of
        from ..core.pipeline import listed_layer_names
        from ..fixes import fix_search

        measured = self.analysis.sqnr.layers
        items = expert_item_names(expert_layers_of(self.analysis))
        chosen = [name for name in measured if fnmatch.fnmatchcase(name, layers)
                  or fnmatch.fnmatchcase(items.get(name, ""), layers)]
        if not chosen:
            _raise_assertion(f"model {self.name!r}: no quantized layer matches {layers!r}; layers: "
                             f"{listed_layer_names(measured, items)}")
        offending = []
        context = self._state.context
        search = fix_search(context)
        fixes = search.layer_fixes(own_error_layers(measured, chosen, min_db))
        for name in chosen:
            entry = measured[name]
            if not entry.sqnr_db >= min_db:
                message = SqnrCheck.message(context, name, entry.sqnr_db, min_db, entry.shadow_sqnr_db,
                                            entry.below_resolution, fixes.get(name, []), search=search)
                offending.append(Finding(model=self.name, check="sqnr", layer=name, metric="sqnr_db",
                                         value=entry.sqnr_db, threshold=min_db, verdict="fail", message=message))
        if offending:
            self._fail(f"model {self.name!r}: {len(offending)} of {len(chosen)} layers below {min_db} dB", offending)

    def assert_model_sqnr(self, min_db: float) -> None:
        """The model's output SQNR is at least `min_db`."""
        __tracebackhide__ = True
        value = self.model_sqnr_db
        if not value >= min_db:
            finding = Finding(model=self.name, check="model_sqnr", layer="output", metric="sqnr_db", value=value,
                              threshold=min_db, verdict="fail", message=(
                                  "see result.table() or assert_sqnr() for the layer where the error starts"))
            self._fail(f"model {self.name!r}: output SQNR {value:.1f} dB < {min_db} dB", [finding])

    def _output_finding(self, check: str, threshold: float) -> Finding:
        """The model's `check` finding judged against `threshold` (measured even if the check was not selected)."""
        from ..checks import KlDivergenceCheck, PerplexityCheck, TaskMetricCheck, Top1AgreementCheck

        classes = {c.name: c for c in (KlDivergenceCheck, Top1AgreementCheck, PerplexityCheck, TaskMetricCheck)}
        context = self._state.context
        setting = classes[check].settings[0].name
        context.settings = context.settings.replace(**{setting: threshold})
        found = classes[check]().findings(context, ["output"])[0]
        if found.verdict == "skip":
            _raise_assertion(found.message)
        return found

    def _assert_output(self, check: str, threshold: float, title: str) -> None:
        __tracebackhide__ = True
        found = self._output_finding(check, threshold)
        if found.failed:
            self._fail(f"model {self.name!r}: {title}", [found])

    def assert_kl(self, max_nats: float) -> None:
        """The mean KL(float || quantized) of the output logits' softmax is at most `max_nats`."""
        __tracebackhide__ = True
        self._assert_output("kl_divergence", max_nats, f"output KL above {max_nats:g} nats")

    def assert_top1_agreement(self, min_agreement: float) -> None:
        """The quantized model keeps the float model's top-1 prediction at a share of at least `min_agreement`
        of the output positions."""
        __tracebackhide__ = True
        self._assert_output("top1_agreement", min_agreement, f"top-1 agreement below {min_agreement:.2%}")

    def assert_perplexity_increase(self, max_pct: float) -> None:
        """The quantized causal LM's next-token perplexity is at most `max_pct` % above the float model's."""
        __tracebackhide__ = True
        self._assert_output("perplexity", max_pct, f"perplexity increase above {max_pct:g}%")

    def assert_task_recovery(self, min_recovery: float) -> None:
        """task_metric (given to analyze) on the quantized model is at least `min_recovery` of the float model's."""
        __tracebackhide__ = True
        if self._state.context.settings.task_metric is None:
            _raise_assertion(f"model {self.name!r}: assert_task_recovery needs qreport.analyze(..., "
                             "task_metric=fn) (and, optionally, eval_batches=...)")
        self._assert_output("task_metric", min_recovery, f"task recovery below {min_recovery:.2%}")

    def assert_checks(self, checks: Iterable[str] | None = None) -> None:
        """No finding of `checks` (default: every check that ran) fails or errors."""
        __tracebackhide__ = True
        wanted = None if checks is None else set(checks)
        offending = [f for f in self.findings if f.failed and (wanted is None or f.check in wanted)]
        if offending:
            self._fail(f"model {self.name!r}: {len(offending)} failing finding(s)", offending)

    def assert_baseline(self, tolerance_db: float | dict[str, float] | None = None) -> None:
        """No finding regressed against `__qreport__/<name>.json` beside the test file (by more than the
        tolerance). With --qreport-update-baseline the file is written instead."""
        __tracebackhide__ = True
        if self._options["update"]:
            if any(f.verdict == "error" for f in self.findings):
                _raise_assertion(f"model {self.name!r} errored: its baseline is not updated")
            if not self._options["controller_writes"]:  # with --qreport the controller writes every baseline
                entries = {(f.check, f.layer): (f.value, f.verdict) for f in self.findings}
                write_baseline(self.baseline_path, self.name, self.fingerprint, entries)
            return
        from ..core.judge import compare_with_baseline
        from ..core.schema import tolerance_pairs

        if not os.path.exists(self.baseline_path):
            _raise_assertion(f"model {self.name!r}: no baseline file {self.baseline_path}; write it with "
                        "pytest --qreport-update-baseline")
        if tolerance_db is not None:
            known = list(self._state.context.checks)
            tolerance = {**self._state.settings.baseline_tolerance_db, **tolerance_pairs(tolerance_db, known)}
            self._state.settings = self._state.settings.replace(baseline_tolerance_db=tolerance)
        options = {"update": False, "strict": self._options["strict"]}
        compared = compare_with_baseline(self._state, self.findings, options)
        self.findings = [f.replace(nodeid=self._nodeid) for f in compared if f.check != "baseline"]
        model_row = next(f for f in compared if f.check == "baseline")
        if model_row.failed:
            _raise_assertion(model_row.message)
        offending = [f for f in self.findings if f.baseline_status == "regressed" and f.failed]
        if offending:
            self._fail(f"model {self.name!r}: {len(offending)} finding(s) regressed against {self.baseline_path}",
                       offending)

    def rows(self) -> list[Finding]:
        """The findings as summary rows, under the test's node id."""
        return list(self.findings)

    def facts(self) -> ModelFacts:
        """What the reports need of this model (baseline file, fingerprint, capture method)."""
        return self._state.facts()


class QReport:
    """The `qreport` fixture object: `analyze(...)` a model with the plugin's checks, settings and baselines."""

    def __init__(self, request: pytest.FixtureRequest) -> None:
        self._request = request

    def analyze(self, model: Any, calibration: Any, example_inputs: Any = None, quantizer: Any = "int8",
                equalize: Any = None, checks: Iterable[str] | str | None = None, name: str | None = None,
                **settings: Any) -> QReportResult:
        """Capture, calibrate, quantize and check `model` once; other qmodel() settings go in `settings`. With
        quantized=... (a model, a fixture name or a callable), `model` is the float reference and the quantized
        model is checked against it as given (artifact mode)."""
        from ..core.errors import QReportModelError
        from ..core.pipeline import analyze_in_session, collect_model, settings_and_quantizer
        from ..core.settings import model_schema, session_settings

        config, node = self._request.config, self._request.node
        name = name or getattr(node, "originalname", None) or node.name
        problem = model_name_problem(name, "qreport.analyze(..., name='...')")
        if problem:
            raise ValueError(problem)
        registry = CheckRegistry()
        config.hook.pytest_qreport_register_checks(registry=registry)
        session = session_settings(config, registry)
        valid = {key for key, setting in model_schema(registry.checks()).items() if "qmodel" in setting.places}
        unknown = sorted(set(settings) - valid)
        if unknown:
            raise TypeError(f"qreport.analyze() got unknown setting(s) {unknown}; valid: {sorted(valid)}")
        batches = as_batches(resolve_source(calibration, self._request.getfixturevalue))
        if not batches:
            raise ValueError(f"model {name!r}: the calibration batches are empty")
        given = {"calibration": batches, "example_inputs": example_inputs, "quantizer": quantizer,
                 "equalize": equalize, "checks": checks, **settings}
        declaration = ModelDeclaration(name=name, factory=lambda: model, source_file=str(self._request.path),
                                       settings={key: value for key, value in given.items() if value is not None})
        resolved, quantizer = settings_and_quantizer(declaration, session, registry, config.hook)
        quantized = None if resolved.quantized is None else resolve_model(resolved.quantized,
                                                                           self._request.getfixturevalue)
        pipeline = collect_model(name, resolved, registry, quantizer, model,
                                 batches[0] if example_inputs is None else example_inputs, quantized)
        pipeline.baseline_path = str(baseline_path(self._request.path.parent, name, session["baseline"]["dir"]))
        resolve = self._request.getfixturevalue
        # judged by the result's assertions (assert_baseline), not when analysed
        analyze_in_session(pipeline, lambda: batches, node.ihook, session,
                           lambda source: as_batches(resolve_source(source, resolve)), judge=False)
        if pipeline.failed:
            raise QReportModelError(pipeline.error) from pipeline.error_cause
        assert pipeline.findings is not None
        options = dict(session["baseline"], controller_writes=bool(config.getoption("qreport")))
        result = QReportResult(pipeline, list(pipeline.findings.values()), options, node.nodeid)
        node.stash.setdefault(FIXTURE_RESULTS, []).append(result)
        node.user_properties += [(item_name(name, f.check, f.layer), f.value) for f in result.findings]
        return result


@pytest.fixture
def qreport(request: pytest.FixtureRequest) -> QReport:
    """Analyse models inside your own tests: `result = qreport.analyze(model, batches)`, then assert on it."""
    return QReport(request)
