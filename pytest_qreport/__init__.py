"""pytest_qreport."""
