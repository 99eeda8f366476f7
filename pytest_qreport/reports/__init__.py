"""Reporters: the terminal summary, JUnit XML, JSON, HTML and baseline updates. Each is a
`pytest_qreport_report` implementation over one immutable `RunResults`; none reads the session."""
