"""pytest entry point: options, and a session plugin registered only with --qreport.

Neither torch nor qcore is imported unless --qreport is given.
"""
from __future__ import annotations

from .options import add_options


def pytest_addoption(parser) -> None:
    add_options(parser)


def pytest_configure(config) -> None:
    if config.getoption("qreport", default=False):
        from .session import QReportSession

        config.pluginmanager.register(QReportSession(config), "qreport-session")
