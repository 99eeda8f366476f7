"""The fix searches, in one place: a check asks `fix_search(model)` for its model's FixSearch once, asks it for the
fixes of its failing layers or output, and prints what it returns. Simulation mode and artifact mode each implement
FixSearch; every trial of every search runs inside it, within the model's fix budget."""
from __future__ import annotations

from typing import TYPE_CHECKING

from ..core.pipeline import is_artifact
from .artifact import ArtifactFixSearch
from .search import BLOCKWISE_NOTE, DEFAULT_BATCHES, MIN_FIX_GAIN_DB, FixSearch, MeasuredFixes, OutputAdvice
from .simulation import DEFAULT_MAX_LAYERS, SimulationFixSearch
from .trials import NOT_TRIED, VERDICT_TRIALS, Advice, Fix, SearchScope, Trial

if TYPE_CHECKING:
    from ..core.registry import ModelContext

__all__ = ["BLOCKWISE_NOTE", "DEFAULT_BATCHES", "DEFAULT_MAX_LAYERS", "MIN_FIX_GAIN_DB", "NOT_TRIED", "VERDICT_TRIALS",
           "Advice", "ArtifactFixSearch", "Fix", "FixSearch", "MeasuredFixes", "OutputAdvice", "SearchScope",
           "SimulationFixSearch", "Trial", "fix_search"]


def fix_search(model: ModelContext) -> FixSearch:
    """The model's fix search: the artifact's when it gates a quantized model the user ships, else the
    simulation's. Its searches are the model's (qcore keeps each configuration measured), whichever check asks."""
    scope = SearchScope(model.name, model.settings, model.analysis, model.checks)
    return ArtifactFixSearch(scope) if is_artifact(model.analysis) else SimulationFixSearch(scope)
