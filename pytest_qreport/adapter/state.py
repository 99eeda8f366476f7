"""What one pytest process keeps for the plugin, and the stash key every adapter reads it under."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pytest

from ..core.layer_cache import LayerCache
from ..core.pipeline import ModelPipeline
from ..core.registry import CheckRegistry
from ..xdist.rendezvous import CaptureRendezvous

__all__ = ["STATE_KEY", "SessionState"]


@dataclass
class SessionState:
    """What one pytest process keeps for the plugin."""

    config: Any
    registry: CheckRegistry = field(default_factory=CheckRegistry)
    settings: dict[str, Any] = field(default_factory=dict)
    models: dict[tuple[str, str], ModelPipeline] = field(default_factory=dict)  # (conftest path, model name) -> it
    one_shot: dict[int, tuple[Any, list]] = field(default_factory=dict)  # id(iterator): (iterator, its batches)
    layer_cache: LayerCache = field(default_factory=lambda: LayerCache(None))
    capture_rendezvous: CaptureRendezvous | None = None  # xdist worker: who captures which model at collection
    declared_models: int = 0  # models declared in the conftest files collected so far
    awaited: dict = field(default_factory=dict)  # (conftest path, model name) -> pipeline another worker captures
    group_collected: dict = field(default_factory=dict)  # (conftest path, model name) -> collected with its group
    memory_available: int | None = None  # bytes available when the session started (the default memory budget)
    held_capture_bytes: int = 0  # parameter bytes of the models captured at collection and kept for their analysis

    @property
    def memory_budget(self) -> int | None:
        """The memory the analyses may add: --qreport-memory-budget, else what was available at the start."""
        return self.settings.get("memory_budget") or self.memory_available

    def refresh_registry(self) -> CheckRegistry:
        """Ask every plugin and conftest.py loaded so far to register its checks (idempotent)."""
        self.config.hook.pytest_qreport_register_checks(registry=self.registry)
        return self.registry

    def replayable(self, source: Any) -> Any:
        """`source`, or for a one-shot iterator (a generator, say) the list of its batches, read once per
        session: collection's example batch and every model sharing the iterator then see all of them."""
        from ..core.batches import is_single_batch

        if is_single_batch(source) or isinstance(source, (list, tuple)):
            return source
        try:
            if iter(source) is not source:
                return source  # re-iterable: a Dataset, a DataLoader, a range
        except TypeError:
            return source  # not iterable at all: as_batches says so
        if id(source) not in self.one_shot:
            self.one_shot[id(source)] = (source, list(source))  # keeping `source` keeps its id unique
        return self.one_shot[id(source)][1]


# where the process keeps its SessionState: pytest's config.stash, typed for the items that read it
STATE_KEY: pytest.StashKey[SessionState] = pytest.StashKey[SessionState]()
