"""pytest-qreport's own hooks. Implement them in a conftest.py or a plugin; they are added with pytest_addhooks.

The built-in checks, quantizer names, the summary table and the JUnit writer are implemented through these
same hooks, so a model repository can extend the gate without forking the plugin.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

import pytest

if TYPE_CHECKING:
    from .core.findings import Finding, RunOutcome
    from .core.registry import CheckRegistry
    from .core.results import RunResults

__all__ = ["pytest_qreport_make_quantizer", "pytest_qreport_modify_findings", "pytest_qreport_register_checks",
           "pytest_qreport_report"]


@pytest.hookspec()
def pytest_qreport_register_checks(registry: CheckRegistry) -> None:
    """Add `Check` subclasses to the registry; each becomes items `qreport/<model>/<check>/<layer>`.

    Called at start-up and again when collection meets a conftest.py that declares models. A check named on
    the command line or in the ini file must come from a plugin or a conftest.py that pytest loads at
    start-up (as for pytest_addoption). Example::

        from pytest_qreport import Check

        class LayerSparsity(Check):
            name, order, metric, higher_is_better = "sparsity", 95, "zero_fraction", False

            def findings(self, model, layers):
                ...

        def pytest_qreport_register_checks(registry):
            registry.register(LayerSparsity)
    """


@pytest.hookspec(firstresult=True)
def pytest_qreport_make_quantizer(name: str) -> Any:
    """Return a qcore Quantizer for a quantizer name used by qmodel(quantizer=...), the ini or
    --qreport-quantizer; None if the name is not yours. The built-in names (int8, int8_per_tensor,
    int8_histogram, module:attribute) are resolved by a trylast implementation. Example::

        def pytest_qreport_make_quantizer(name):
            if name == "int8_no_head":
                return qcore.Int8StaticQuantizer(layer_overrides={"head": {"skip": True}})
    """


@pytest.hookspec()
def pytest_qreport_modify_findings(model: str, findings: list[Finding]) -> None:
    """Waive or annotate a model's findings after its analysis, by replacing entries of `findings` in place.

    A waived finding passes, and the summary table and both XML files show its verdict and reason. Example::

        def pytest_qreport_modify_findings(model, findings):
            for index, finding in enumerate(findings):
                if model == "bert" and finding.check == "outlier" and finding.layer == "classifier":
                    findings[index] = finding.waive("known outlier, tracked in #123")
    """


@pytest.hookspec()
def pytest_qreport_report(rows: list[Finding], config: pytest.Config, outcome: RunOutcome,
                          results: RunResults) -> str | list[str] | None:
    """Write extra outputs at the end of a --qreport session, on the controller process only.

    `results` is one immutable RunResults: `results.rows` holds every qreport finding of the session in
    collection order, with `nodeid` and `duration` set; `results.models` the facts of each model (baseline file,
    fingerprint, capture method, errors), by the name its rows carry; `results.outcome` how complete the rows are:
    after Ctrl-C or -x, `outcome.interrupted` says why the run stopped and `outcome.not_run` how many collected
    items did not run, and a writer may then keep its previous file. `rows` and `outcome` are the same as
    `results.rows` and `results.outcome`. Return a line (or lines) for the terminal, such as the path written;
    raise `pytest_qreport.ReportError` when the output cannot be written: the session prints the message, fails,
    and the other reporters still run. The summary table and the JUnit, JSON and HTML writers implement this
    hook. Example::

        def pytest_qreport_report(results):
            failing = [row.to_dict() for row in results.rows if row.failed]
            pathlib.Path("qreport-failing.json").write_text(json.dumps(failing))
            return "qreport: failing rows written to qreport-failing.json"
    """
