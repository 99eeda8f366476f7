"""pytest entry point: options, hookspecs, and a session plugin registered only with --qreport.

Neither torch nor qcore is imported unless --qreport is given.
"""
from __future__ import annotations

from .adapter.fixture import qreport
from .core.settings import add_options

__all__ = ["pytest_addhooks", "pytest_addoption", "pytest_configure", "qreport"]


def pytest_addoption(parser) -> None:
    """Register the --qreport flags and ini keys (the built-in checks' thresholds among them)."""
    from .checks import BUILTIN_CHECKS

    add_options(parser, BUILTIN_CHECKS)


def pytest_addhooks(pluginmanager) -> None:
    """Add pytest-qreport's own hooks (see pytest_qreport.hookspecs)."""
    from . import hookspecs

    pluginmanager.add_hookspecs(hookspecs)


def pytest_configure(config) -> None:
    """Register the built-in checks and quantizer names (the qreport fixture uses them too); with --qreport
    also the reports and the session, then check the options."""
    from . import checks
    from .core import quantizers

    for name, module in (("qreport-checks", checks), ("qreport-quantizers", quantizers)):
        if not config.pluginmanager.has_plugin(name):
            config.pluginmanager.register(module, name)
    if not config.getoption("qreport", default=False):
        return
    from .adapter.heap import QuietHeapAtEnd
    from .adapter.session import QReportSession
    from .reports import github, html, jsonfile, junit, terminal

    # items carry one xdist_group per model; without pytest-xdist nobody else registers the marker
    config.addinivalue_line("markers", "xdist_group(name): pytest-xdist --dist loadgroup runs a group in one worker")

    for name, module in (("qreport-summary", terminal), ("qreport-junit", junit), ("qreport-json", jsonfile),
                         ("qreport-html", html), ("qreport-github", github)):
        if not config.pluginmanager.has_plugin(name):
            config.pluginmanager.register(module, name)
    if not config.pluginmanager.has_plugin("qreport-heap"):
        config.pluginmanager.register(QuietHeapAtEnd(), "qreport-heap")
    session = QReportSession(config)
    config.pluginmanager.register(session, "qreport-session")
    session.start()
