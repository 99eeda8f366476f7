"""The errors the plugin explains itself: their message is the whole report of the item they stop."""
from __future__ import annotations

__all__ = ["QReportAssertionError", "QReportCheckFailed", "QReportError", "QReportModelError", "ReportError"]


class QReportError(Exception):
    """A problem the plugin explains itself: the message is the whole report."""


class QReportModelError(QReportError):
    """The model could not be captured, calibrated or analysed."""


class QReportCheckFailed(QReportError):
    """A quality check is below its threshold."""


class ReportError(QReportError):
    """A report file could not be written; the session prints the message and fails."""


class QReportAssertionError(AssertionError):
    """A `QReportResult.assert_*` that does not hold. An AssertionError, as torch.testing.assert_close and
    unittest's assertions raise, so that `pytest.raises(AssertionError)`, hypothesis and plain callers catch it;
    its message is the whole explanation."""

    __module__ = "pytest_qreport"  # how pytest names it in a failure: the public name
