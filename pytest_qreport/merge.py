"""python -m pytest_qreport.merge: the JSON reports of --qreport-shard runs joined into one report.

    python -m pytest_qreport.merge shard-*.json --json qreport.json --junitxml qreport.xml --html qreport.html

It prints the summary table, writes the merged JSON (the rows one unsharded run gives, in its order), JUnit XML and
HTML, and exits 1 when a row fails or errors, 2 when the inputs cannot be merged (a file that is not a report,
reports of different plugin versions or collections, a missing shard, a model in two shards: each named), else 0.
Under GitHub Actions it also writes the step summary and the annotations, as a run does.
"""
from __future__ import annotations

import argparse
import datetime
import json
import sys
from collections.abc import Sequence
from typing import Any

from .core.files import write_atomically
from .core.findings import Finding
from .core.nodeids import parse_item_nodeid
from .core.results import ModelFacts
from .xdist.durations import work_unit

__all__ = ["MergeError", "main", "merge_reports"]

_NUMBERS = ("value", "threshold", "baseline", "delta", "duration")


class MergeError(ValueError):
    """The reports cannot be merged; the message names the files and why."""


def load_report(path: str) -> dict[str, Any]:
    """One shard's JSON report; MergeError naming the file when it is not one."""
    try:
        with open(path, encoding="utf-8") as file:
            report = json.load(file)
    except OSError as error:
        raise MergeError(f"{path}: cannot be read ({error.strerror or error})") from None
    except ValueError as error:
        raise MergeError(f"{path}: not a JSON report ({error}): truncated or corrupt? Run that shard again") from None
    if not (isinstance(report, dict) and report.get("schema") == 1 and isinstance(report.get("rows"), list)
            and isinstance(report.get("models"), dict) and isinstance(report.get("versions"), dict)):
        raise MergeError(f"{path}: not a pytest-qreport JSON report of schema 1 (written by --qreport-json)")
    return report


def _unit(row: dict[str, Any]) -> str:
    return work_unit(str(row.get("nodeid", "")))


def _check_shards(reports: Sequence[dict[str, Any]], paths: Sequence[str]) -> None:
    versions = {path: report["versions"].get("pytest_qreport") for path, report in zip(paths, reports)}
    if len(set(versions.values())) > 1:
        raise MergeError("the reports come from different plugin versions: "
                         + ", ".join(f"{path} has {version}" for path, version in versions.items()))
    if len(reports) == 1 and reports[0].get("shard") is None:
        return  # one whole run
    unsharded = [path for path, report in zip(paths, reports) if not isinstance(report.get("shard"), dict)]
    if unsharded:
        raise MergeError(f"{', '.join(unsharded)}: not a --qreport-shard run; merge the reports of one sharded run")
    shards: list[dict[str, Any]] = [report["shard"] for report in reports]
    counts = {path: shard["count"] for path, shard in zip(paths, shards)}
    if len(set(counts.values())) > 1:
        raise MergeError("the reports come from different shard counts: "
                         + ", ".join(f"{path} is shard {shard['index']}/{shard['count']}"
                                     for path, shard in zip(paths, shards)))
    count = next(iter(counts.values()))
    seen: dict[int, str] = {}
    for path, shard in zip(paths, shards):
        if shard["index"] in seen:
            raise MergeError(f"shard {shard['index']}/{count} is given twice: {seen[shard['index']]} and {path}")
        seen[shard["index"]] = path
    missing = [f"{index}/{count}" for index in range(1, count + 1) if index not in seen]
    if missing:
        raise MergeError(f"missing shard(s) {', '.join(missing)}: give every shard's report (a shard with no model "
                         "writes an empty one)")
    if any(shard["units"] != shards[0]["units"] for shard in shards):
        raise MergeError("the shards collected different models (their code or their -k/-m options differ): "
                         + "; ".join(f"{path}: {len(shard['units'])} model(s)" for path, shard in zip(paths, shards)))
    owner: dict[str, str] = {}
    for path, shard, report in zip(paths, shards, reports):
        ran = set(shard["run"]) | {_unit(row) for row in report["rows"] if parse_item_nodeid(row.get("nodeid", ""))}
        for unit in ran:
            if unit in owner:
                raise MergeError(f"model {unit} is in two shards: {owner[unit]} and {path}")
            owner[unit] = path


def merge_reports(reports: Sequence[dict[str, Any]], paths: Sequence[str]) -> dict[str, Any]:
    """One report from the shards' reports: every model's rows in the collection order of an unsharded run (the
    rows of other tests after them, shard by shard); MergeError when they cannot be merged."""
    _check_shards(reports, paths)
    units = list(reports[0].get("shard", {}).get("units", []))
    position = {unit: index for index, unit in enumerate(units)}
    keyed: list[tuple[tuple[int, int, int], dict[str, Any]]] = []
    seen: dict[tuple[Any, ...], str] = {}
    for order, (path, report) in enumerate(zip(paths, reports)):
        for index, row in enumerate(report["rows"]):
            nodeid = str(row.get("nodeid", ""))
            key = (nodeid, row.get("model"), row.get("check"), row.get("layer"))
            if key in seen:
                raise MergeError(f"{nodeid or row.get('model')}: reported by {seen[key]} and {path}; run tests that "
                                 "are not qreport items in one shard only")
            seen[key] = path
            keyed.append(((position.get(_unit(row), len(units)), order if _unit(row) not in position else 0, index),
                          row))
    models: dict[str, Any] = {}
    for path, report in zip(paths, reports):
        for name, facts in report["models"].items():
            if name in models and models[name] != facts:
                raise MergeError(f"model {name!r} is in two shards (its facts differ in {path})")
            models[name] = facts
    merged = {"schema": 1, "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "versions": reports[0]["versions"], "models": dict(sorted(models.items())),
              "rows": [row for _key, row in sorted(keyed, key=lambda entry: entry[0])], "merged_from": list(paths)}
    return merged


def _finding(row: dict[str, Any]) -> Finding:
    numbers = {key: float(row[key]) if isinstance(row.get(key), str) else row.get(key) for key in _NUMBERS
               if key in row}
    return Finding.from_dict({**row, **numbers})


def _write(path: str, text: str, what: str) -> str:
    write_atomically(path, text)
    return f"qreport merge: {what} written to {path}"


def main(argv: Sequence[str] | None = None) -> int:
    """Merge, print, write; the exit status (0, 1 failing rows, 2 inputs that cannot be merged)."""
    parser = argparse.ArgumentParser(prog="python -m pytest_qreport.merge", description=__doc__.splitlines()[0])
    parser.add_argument("reports", nargs="+", metavar="REPORT", help="the shards' --qreport-json files")
    parser.add_argument("--json", metavar="OUT", help="write the merged JSON report")
    parser.add_argument("--junitxml", metavar="OUT", help="write the merged JUnit XML (one testsuite per model)")
    parser.add_argument("--html", metavar="OUT", help="write the merged HTML report (pytest-qreport[html])")
    parser.add_argument("--table", choices=("failures", "all"), default="failures", help="summary rows to print")
    args = parser.parse_args(argv)
    try:
        merged = merge_reports([load_report(path) for path in args.reports], args.reports)
    except MergeError as error:
        print(f"qreport merge: {error}", file=sys.stderr)
        return 2
    from .reports.github import github_output
    from .reports.junit import junit_text
    from .reports.terminal import counts_line, render_summary

    rows = [_finding(row) for row in merged["rows"]]
    models = {name: ModelFacts.from_dict({**facts, "name": name}) for name, facts in merged["models"].items()}
    table = render_summary(rows, args.table)
    print(table if table else "all qreport checks passed")
    print(counts_line(rows, mode=args.table))
    lines = []
    if args.json:
        lines.append(_write(args.json, json.dumps(merged, indent=1, sort_keys=True) + "\n", "JSON report"))
    if args.junitxml:
        lines.append(_write(args.junitxml, junit_text(rows, models), "JUnit XML"))
    if args.html:
        from .reports.html import build_html, html_extra_missing

        missing = html_extra_missing()
        if missing:
            print(f"qreport merge: {missing}", file=sys.stderr)
            return 2
        lines.append(_write(args.html, build_html(merged), "HTML report"))
    lines += github_output(rows, models, args.table)
    for line in lines:
        print(line)
    return 1 if any(row.failed for row in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
