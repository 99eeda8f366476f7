"""Checks of mixture-of-experts blocks: the calibration tokens each expert received (expert_coverage)."""
from __future__ import annotations

import math
from typing import Any

from ..core.findings import Finding
from ..core.pipeline import is_artifact
from ..core.registry import Check, ModelContext
from ..core.schema import Setting, fraction, number
from ..fixes import fix_search

__all__ = ["ExpertCoverageCheck", "RoutingAgreementCheck", "calibrate_every_expert_fix"]

_NAMED = 8  # the starved experts a message names


_EVERY_EXPERT = {
    "compressed-tensors": "llm-compressor: oneshot(..., moe_calibrate_all_experts=True)",
    "modelopt": "ModelOpt: quant_cfg['algorithm'] = {'method': 'max', 'moe_calib_experts_ratio': 1.0}",
    "gptqmodel": "GPTQModel: QuantizeConfig(..., moe=MoEConfig(routing=ExpertsRoutingBypass()))",
}


def calibrate_every_expert_fix(tool: str | None = None) -> str:
    """How the tool that made a checkpoint (every tool that quantizes MoE models, when unknown) routes every
    calibration token through every expert, in its own words."""
    if tool in _EVERY_EXPERT:
        return _EVERY_EXPERT[tool]
    return "; ".join(_EVERY_EXPERT.values())


class ExpertCoverageCheck(Check):
    """The fewest calibration tokens any expert of an MoE block received: an expert calibration never reaches gets
    no activation range, and GPTQ writes it as zeros (its Hessian is empty)."""

    name, order, metric, needs = "expert_coverage", 25, "expert_tokens", frozenset({"detectors"})
    settings = (Setting("expert_tokens_min", number("tokens", non_negative=True), 32.0,
                        "fewest calibration tokens each expert of an MoE block must receive", metavar="TOKENS"),)
    # in artifact mode: the checkpoint's experts, each against the reference's (zeros, NaN, a weight far off)
    measures_artifacts = True

    def bind(self, model: ModelContext) -> None:
        """The detector that counts each expert's tokens in the shared calibration pass."""
        from qcore.report import ExpertCoverageDetector

        self.detector = None if is_artifact(model.analysis) else ExpertCoverageDetector()

    def applies(self, model: ModelContext) -> bool:
        if is_artifact(model.analysis):
            return bool(model.analysis.expert_blocks)
        return bool(getattr(model.analysis, "moe_blocks", None))

    def layers(self, model: ModelContext) -> list[str]:
        if is_artifact(model.analysis):
            return list(model.analysis.expert_blocks)
        return list(model.analysis.moe_blocks)

    def findings(self, model: ModelContext, layers: list[str]) -> list[Finding]:
        if is_artifact(model.analysis):
            compared = model.analysis.checkpoint_experts
            return [self._checkpoint_finding(model, compared[block]) if block in compared else self.finding(
                model, block, math.nan, 0.0, passed=False, message=(
                    f"block {block}: no expert of the checkpoint pairs with the reference's by shape, so none could "
                    "be compared. Fix: the qmodel function must return the float model the checkpoint was made "
                    "from")) for block in layers]
        report, threshold = model.detector_report(self.name), float(model.settings.expert_tokens_min)
        results = []
        for block in layers:
            entry: dict[str, Any] = report.get(block, {})
            tokens = [int(t) for t in entry.get("tokens", [])]
            if not tokens:
                results.append(self.finding(model, block, float("nan"), threshold, passed=False, message=(
                    f"block {block}: its experts' tokens were not counted (no expert projection was found in the "
                    "captured graph).")))
                continue
            fewest = min(tokens)
            starved = sorted((expert for expert, count in enumerate(tokens) if count < threshold),
                             key=lambda expert: tokens[expert])
            named = ", ".join(f"{expert} ({tokens[expert]})" for expert in starved[:_NAMED])
            more = f" and {len(starved) - _NAMED} more" if len(starved) > _NAMED else ""
            message = (
                f"block {block}: {len(starved)} of its {len(tokens)} experts received fewer than {threshold:g} "
                f"calibration tokens (of {sum(tokens)} routed in the block over {entry.get('batches', 0)} batches): "
                f"expert (tokens) {named}{more}. An expert calibration does not reach keeps activation scales that saw "
                "nothing, and GPTQ writes its weights as zeros (its Hessian is empty); its items here measure it on "
                "those few tokens only. Fix: calibrate on more samples, or have the tool route every calibration "
                f"token through every expert ({calibrate_every_expert_fix()}); or lower expert_tokens_min.")
            results.append(self.finding(model, block, float(fewest), threshold, message=message, details={
                "tokens": tokens, "starved_experts": starved}))
        return results


    def _checkpoint_finding(self, model: ModelContext, block: Any) -> Finding:
        """The experts a checkpoint holds as zeros, with values that are not finite, or with a weight SQNR far below
        their siblings' (its value: how many)."""
        far: dict[int, str] = {}
        for parameter, values in block.weight_sqnr_db.items():
            finite = sorted(v for v in values if math.isfinite(v))
            if not finite:
                continue
            median = finite[len(finite) // 2]
            for expert, value in enumerate(values):
                if math.isfinite(value) and value < median - SIBLING_GAP_DB and expert not in far \
                        and expert not in block.zeros:
                    far[expert] = f"{parameter} {value:.1f} dB against its siblings' median {median:.1f} dB"
        scaled: dict[int, tuple[str, float, float, float]] = {}  # expert: (parameter, SQNR, factor, fitted SQNR)
        for parameter, values in block.weight_sqnr_db.items():
            fits = block.scale_fit.get(parameter, [])
            for expert, (value, (factor, fitted)) in enumerate(zip(values, fits, strict=False)):
                # no closer to the reference's weights than zeros are, yet a scaled copy of them
                if value <= 0.0 and fitted >= MISSCALED_FIT_DB and expert not in block.zeros and expert not in scaled:
                    scaled[expert] = (parameter, value, factor, fitted)
        for expert in scaled:
            far.pop(expert, None)
        damaged = sorted(set(block.zeros) | set(block.non_finite) | set(far) | set(scaled))
        details = {"experts": block.experts, "zeros": list(block.zeros), "non_finite": list(block.non_finite),
                   "far_below_siblings": sorted(far), "scaled_wrong": sorted(scaled),
                   "weight_sqnr_db": block.weight_sqnr_db,
                   "weight_scale_factor": {p: [fit[0] for fit in fits] for p, fits in block.scale_fit.items()}}
        held = any(entry.block == block.block for entry in (getattr(model.analysis, "expert_layers", None) or
                                                             {}).values())
        note = ("the experts' weights were compared one by one with the reference's; their outputs are judged "
                + ("by the sqnr items of the block's projections (each expert on the reference's tokens)" if held
                   else "through the model's output items"))
        if not damaged:
            return self.finding(model, block.block, 0.0, 0.0, passed=True, details=details, note=note)
        parts = []
        if block.zeros:
            parts.append(f"as zeros: expert(s) {_listed(block.zeros)} (GPTQ writes an expert that no calibration "
                         "token reached as zeros)")
        if block.non_finite:
            parts.append(f"with NaN or infinite values: expert(s) {_listed(block.non_finite)}")
        if far:
            parts.append("with a weight SQNR far below their siblings': " + "; ".join(
                f"expert {expert} ({text})" for expert, text in sorted(far.items())[:_NAMED]))
        if scaled:
            first = scaled[min(scaled)]
            parts.append(f"scaled wrong: expert(s) {_listed(scaled)} hold their reference weights times about "
                         f"{first[2]:.4g} ({first[0]} of expert {min(scaled)}: weight SQNR {first[1]:.1f} dB, "
                         f"{first[3]:.1f} dB once that factor is divided out)")
        tool = getattr(model.analysis, "tool", None)
        fixes = []
        if set(damaged) - set(scaled):
            fixes.append("quantize again with every expert calibrated (" + calibrate_every_expert_fix(tool)
                         + "), or on more calibration samples")
        if scaled:
            fixes.append("the model computes with these weights as loaded, so its loader applied a scale the wrong "
                         "way (dividing where it should multiply, or the reverse): load the checkpoint with one that "
                         "reads its scales as the tool wrote them, and gate the model it gives")
        message = (f"block {block.block}: the checkpoint holds {len(damaged)} of its {block.experts} experts "
                   + ", and ".join(parts) + ". Fix: " + "; ".join(fixes) + ".")
        return self.finding(model, block.block, float(len(damaged)), 0.0, passed=False, message=message,
                            details=details)


SIBLING_GAP_DB = 10.0  # an expert's weight SQNR this far below its siblings' median is named as damaged
MISSCALED_FIT_DB = 10.0  # a weight no closer than zeros that is a scaled copy to this SQNR was scaled wrong


def _listed(experts: Any) -> str:
    experts = list(experts)
    return ", ".join(map(str, experts[:_NAMED])) + (f" and {len(experts) - _NAMED} more" if len(experts) > _NAMED
                                                     else "")


class RoutingAgreementCheck(Check):
    """The share of calibration tokens whose top-k experts the quantized router, fed the float block input, chooses
    as the float router does: a flipped choice sends a token to other experts, an error no per-layer SQNR shows."""

    name, order, metric, needs = "routing_agreement", 26, "agreement", frozenset({"sqnr"})
    artifact_skip = ("compares the choice of a router that qcore quantizes with the float router's; in artifact mode "
                     "(quantized=) the tool chose which routers to quantize: a router it quantized is a layer of the "
                     "artifact, judged by its sqnr item, and tokens sent to other experts show in the output checks")
    settings = (Setting("routing_agreement_min", fraction(), 0.95,
                        "least share of tokens whose top-k experts the quantized router keeps", metavar="SHARE"),)

    def applies(self, model: ModelContext) -> bool:
        return bool(getattr(model.analysis, "moe_blocks", None)) and hasattr(type(model.analysis), "routing_agreement")

    def layers(self, model: ModelContext) -> list[str]:
        return list(getattr(model.analysis, "moe_blocks", None) or ())  # an artifact's routers are not chosen here

    def findings(self, model: ModelContext, layers: list[str]) -> list[Finding]:
        measured, threshold = model.analysis.routing_agreement, float(model.settings.routing_agreement_min)
        search = fix_search(model)
        routers, quantized = model.analysis.routers, set(search.quantized_layers())
        results = []
        for block in layers:
            entry = measured.get(block)
            router = routers.get(block)
            if router is not None and router.layer not in quantized:
                results.append(self.finding(model, block, 1.0, threshold, note=(
                    f"its router {router.layer} is not quantized: it chooses as the float model does"), details={
                    "router": router.layer, "top_k": router.top_k}))
                continue
            if entry is None or router is None:
                results.append(Finding(
                    model=model.name, check=self.name, layer=block, metric=self.metric, value=float("nan"),
                    threshold=threshold, verdict="skip", message=(
                        f"block {block}: its routing is not compared: its experts are not chosen as the top-k of one "
                        "layer's output (DeepSeek-V3 adds a score correction bias and chooses by groups first). "
                        "Its experts' items and the model's output items still judge it.")))
                continue
            value = float(entry["agreement"])
            fix = search.keep_in_float([router.layer]).paste()
            message = (f"block {block}: the quantized router {router.layer} keeps the float model's top-{router.top_k} "
                       f"experts for {value:.1%} of {int(entry['tokens'])} calibration tokens, below "
                       f"routing_agreement_min {threshold:g}: the others go to other experts. Routers are small: "
                       f"keep it in float, as the tools do (llm-compressor's ignore=['re:.*mlp.gate$']), with "
                       f"qmodel(..., {fix}); or lower routing_agreement_min.")
            results.append(self.finding(model, block, value, threshold, message=message, details={
                "router": router.layer, "top_k": router.top_k, "tokens": int(entry["tokens"])}))
        return results
