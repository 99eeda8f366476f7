"""How qreport items are named: `qreport/<model>/<check>/<layer>` under the declaring conftest.py."""
from __future__ import annotations

__all__ = ["item_name", "model_scope", "parse_item_nodeid"]

_PREFIX = "::qreport/"


def item_name(model: str, check: str, layer: str = "") -> str:
    """The item's name inside its conftest.py: `qreport/<model>/<check>[/<layer>]`."""
    return f"qreport/{model}/{check}/{layer}" if layer else f"qreport/{model}/{check}"


def model_scope(file_nodeid: str, model: str) -> str:
    """The work unit that keeps one model's items together under xdist: `<conftest>::qreport/<model>`."""
    return f"{file_nodeid}::qreport/{model}"


def parse_item_nodeid(nodeid: str) -> tuple[str, str, str, str] | None:
    """(file, model, check, layer) of a qreport item's node id, or None for other tests."""
    if _PREFIX not in nodeid:
        return None
    file, name = nodeid.split(_PREFIX, 1)
    name = name.rsplit("@", 1)[0]  # --dist loadgroup appends "@<group>"; layer names hold no "@"
    model, _, rest = name.partition("/")  # a model name holds no "/" (declare.model_name_problem)
    check, _, layer = rest.partition("/")
    return (file, model, check, layer) if model and check else None
