"""The fix search of a model qcore quantizes in simulation: the output's fix is a float_layers search, or, under a
format quantizer, a search up the format ladder (qcore's searches, screened on a few batches and confirmed on
every batch)."""
from __future__ import annotations

from collections.abc import Callable, Collection
from typing import Any

from .search import BLOCKWISE_NOTE, DEFAULT_BATCHES, DEFAULT_CANDIDATES, FixSearch, OutputAdvice
from .trials import Fix, max_float_layers

__all__ = ["DEFAULT_MAX_LAYERS", "SimulationFixSearch"]

DEFAULT_MAX_LAYERS = 32  # the sensitivity ranking's layers (graph order), the float_layers search's candidates


class SimulationFixSearch(FixSearch):
    """The fix searches of a model quantized in simulation (qmodel without quantized=)."""

    def variant(self, fix: Fix, reads: Collection[str]) -> Any:
        """The model quantized again with the quantizer the fix gives it (layer_overrides, float_layers), or equalized
        as it says; measuring the layers the fix concerns (every layer when one of them is not a layer's name)."""
        from qcore.analysis import LAYER_KINDS, with_float_layers, with_layer_overrides

        analysis = self.scope.analysis
        layers = fix.layers if set(fix.layers) <= {entry.layer for entry in analysis.layers} else None
        kinds = LAYER_KINDS & set(reads)
        if fix.setting == "layer_overrides":
            return analysis.variant(with_layer_overrides(analysis.quantizer, fix.value), layers=layers,
                                    layer_kinds=kinds)
        if fix.setting == "float_layers":
            return analysis.variant(with_float_layers(analysis.quantizer, fix.value), layers=layers, layer_kinds=kinds)
        if fix.setting == "equalize":
            return analysis.variant(equalize=fix.value, layers=layers, layer_kinds=kinds)
        raise ValueError(f"no verified fix sets {fix.setting!r}")

    def output_float_layers_search(self, target_db: float) -> Any | None:
        options = self.scope.options("model_sqnr")
        analysis = self.scope.analysis
        if options.get("fix") is False or analysis.blockwise or self.recipe() is not None:
            return None
        if not isinstance(getattr(analysis.quantizer, "layer_overrides", None), dict):
            return None
        ranked = self.scope.options("sensitivity")
        return analysis.float_layers_fix(target_db, max_float_layers(self.scope, "model_sqnr"),
                                         options.get("batches", DEFAULT_BATCHES),
                                         int(options.get("candidates", DEFAULT_CANDIDATES)),
                                         int(ranked.get("max_layers", DEFAULT_MAX_LAYERS)))

    def output_fix(self, check: str, metric: str, target: float, batches: list[Any] | None = None,
                   show: Callable[[float], str] = lambda value: f"{value:.4g}") -> OutputAdvice:
        """The model_sqnr item's fix (format moves under a format quantizer, else float_layers) and the recipe of a
        model in deployed formats; the other output checks point to the layer search instead (no text)."""
        if check != "model_sqnr":
            return OutputAdvice("")
        formats = self.recipe()
        if formats is None:
            return self._float_layers_advice(target)
        options = self.scope.options("model_sqnr")
        if options.get("fix") is False:
            return OutputAdvice("", formats)
        analysis = self.scope.analysis
        if analysis.blockwise:
            return OutputAdvice(f" ({BLOCKWISE_NOTE.format(search='format search')})", formats)
        fix = analysis.format_fix(target, int(options.get("max_moves", 16)), options.get("batches", DEFAULT_BATCHES))
        if not fix.layer_formats:
            return OutputAdvice(self.further(), formats, unsearched=True) if fix.stopped else OutputAdvice("", formats)
        formats["layers"].update(fix.layer_formats)
        layers = formats["layers"]
        if fix.reached:
            return OutputAdvice(f" Moving {len(fix.layer_formats)} layer(s) up the format ladder was measured to reach "
                                f"{fix.measured_db:.1f} dB: layer_formats={layers!r}", formats, "layer_formats")
        within = " that the search measured within the fix budget" if fix.stopped else ""
        return OutputAdvice(f" No set of up to {len(fix.layer_formats)} format moves{within} reaches {target:.1f} dB"
                            + (f".{self.further()} The best found" if fix.stopped else "; the best found")
                            + f", layer_formats={layers!r}, was measured at {fix.measured_db:.1f} dB.", formats,
                            "layer_formats")

    def _float_layers_advice(self, target_db: float) -> OutputAdvice:
        """The verified fix for a low model output SQNR: a float_layers line to paste and the SQNR it reached."""
        if self.scope.options("model_sqnr").get("fix") is False:
            return OutputAdvice("")
        analysis = self.scope.analysis
        if not isinstance(getattr(analysis.quantizer, "layer_overrides", None), dict):
            return OutputAdvice(" (No float_layers fix is searched: this quantizer has no layer_overrides to keep "
                                "layers in float.)")
        if analysis.blockwise:
            return OutputAdvice(f" ({BLOCKWISE_NOTE.format(search='float_layers search')})")
        fix = self.output_float_layers_search(target_db)
        if fix is None or not fix.float_layers:
            return OutputAdvice(self.further(), unsearched=True) if fix is not None and fix.stopped \
                else OutputAdvice("")
        layers = list(self.scope.settings.float_layers or []) + list(fix.float_layers)
        if fix.reached:
            return OutputAdvice(f" Keeping {len(fix.float_layers)} layer(s) in float was measured to reach "
                                f"{fix.measured_db:.1f} dB: float_layers={layers!r}", setting="float_layers")
        if fix.stopped:
            return OutputAdvice(f" No set of up to {len(fix.float_layers)} layers kept in float that the search "
                                f"measured within the fix budget reaches {target_db:.1f} dB.{self.further()} The "
                                f"best found, float_layers={layers!r}, was measured at {fix.measured_db:.1f} dB.",
                                setting="float_layers")
        return OutputAdvice(f" No set of up to {len(fix.float_layers)} layers kept in float reaches {target_db:.1f} dB "
                            f"({self.search_limit(len(fix.float_layers), 'model_sqnr')}); the best found, "
                            f"float_layers={layers!r}, was measured at {fix.measured_db:.1f} dB.",
                            setting="float_layers")
        return (f" No set of up to {len(fix.float_layers)} layers kept in float reaches {target_db:.1f} dB "
                f"({self.search_limit(len(fix.float_layers), 'model_sqnr')}); the best found, "
                f"float_layers={layers!r}, was measured at {fix.measured_db:.1f} dB.")
