"""Session state: per-process model states (workers) and the finding rows (controller)."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SessionState:
    """What one pytest process keeps for the plugin."""

    models: dict = field(default_factory=dict)
    rows: list[tuple[list, dict]] = field(default_factory=list)

    def add_row(self, position: list, row: dict) -> None:
        """Keep a finding row (from any worker) with its collection position."""
        self.rows.append((list(position), row))

    def ordered_rows(self) -> list[dict]:
        """Rows in collection order, whatever order the workers finished in."""
        return [row for _, row in sorted(self.rows, key=lambda pair: pair[0])]
