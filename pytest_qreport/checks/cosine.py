"""Cosine similarity of each quantized layer's output with the float model's (error propagated): a scale-free
view of the same comparison as `sqnr`. Off by default; turn it on with severity={'cosine': 'fail'}."""
from __future__ import annotations

import math

from ..core.findings import Finding
from ..core.registry import Check, ModelContext
from ..core.schema import Setting, fraction
from .sqnr import unreached_expert_finding

__all__ = ["CosineCheck"]


class CosineCheck(Check):
    """Cosine similarity of each quantized layer's output, quantized model against float model."""

    name, order, metric, needs, default_severity = "cosine", 15, "cosine", frozenset({"sqnr"}), "off"
    measures_artifacts = True
    settings = (Setting("cosine_min", fraction(), 0.999, "minimum cosine similarity of each quantized layer's "
                        "output with the float model's", metavar="COS"),)

    def findings(self, model: ModelContext, layers: list[str]) -> list[Finding]:
        threshold, measured = model.settings.cosine_min, model.analysis.sqnr.layers
        results = []
        for layer in layers:
            entry = measured.get(layer)
            if entry is not None and entry.batches == 0 and math.isnan(entry.cosine):  # an expert no token reached
                results.append(unreached_expert_finding(self, model, layer, threshold))
                continue
            value = math.nan if entry is None else float(entry.cosine)
            message = (f"layer {layer}: cosine similarity {value:.5f} < {threshold:g} with the float output. See this "
                       f"layer's sqnr item for where the error comes from and what to change.")
            results.append(self.finding(model, layer, value, threshold, message=message,
                                        details={"sqnr_db": None if entry is None else entry.sqnr_db}))
        return results
