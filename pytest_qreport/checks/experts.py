"""Checks of mixture-of-experts blocks: the calibration tokens each expert received (expert_coverage)."""
from __future__ import annotations

from typing import Any

from ..core.findings import Finding
from ..core.registry import Check, ModelContext
from ..core.schema import Setting, fraction, number
from .advice import float_layers_fix, quantized_layer_names

__all__ = ["ExpertCoverageCheck", "RoutingAgreementCheck", "calibrate_every_expert_fix"]

_NAMED = 8  # the starved experts a message names


def calibrate_every_expert_fix() -> str:
    """How each tool that quantizes MoE models routes every calibration token through every expert, in its words."""
    return ("llm-compressor: oneshot(..., moe_calibrate_all_experts=True); ModelOpt: "
            "quant_cfg['algorithm'] = {'method': 'max', 'moe_calib_experts_ratio': 1.0}; GPTQModel: "
            "QuantizeConfig(..., moe=MoEConfig(routing=ExpertsRoutingBypass()))")


class ExpertCoverageCheck(Check):
    """The fewest calibration tokens any expert of an MoE block received: an expert calibration never reaches gets
    no activation range, and GPTQ writes it as zeros (its Hessian is empty)."""

    name, order, metric, needs = "expert_coverage", 25, "expert_tokens", frozenset({"detectors"})
    settings = (Setting("expert_tokens_min", number("tokens", non_negative=True), 32.0,
                        "fewest calibration tokens each expert of an MoE block must receive", metavar="TOKENS"),)

    def bind(self, model: ModelContext) -> None:
        """The detector that counts each expert's tokens in the shared calibration pass."""
        from qcore.report import ExpertCoverageDetector

        self.detector = ExpertCoverageDetector()

    def applies(self, model: ModelContext) -> bool:
        return bool(getattr(model.analysis, "moe_blocks", None))

    def layers(self, model: ModelContext) -> list[str]:
        return list(model.analysis.moe_blocks)

    def findings(self, model: ModelContext, layers: list[str]) -> list[Finding]:
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


class RoutingAgreementCheck(Check):
    """The share of calibration tokens whose top-k experts the quantized router, fed the float block input, chooses
    as the float router does: a flipped choice sends a token to other experts, an error no per-layer SQNR shows."""

    name, order, metric, needs = "routing_agreement", 26, "agreement", frozenset({"sqnr"})
    settings = (Setting("routing_agreement_min", fraction(), 0.95,
                        "least share of tokens whose top-k experts the quantized router keeps", metavar="SHARE"),)

    def applies(self, model: ModelContext) -> bool:
        return bool(getattr(model.analysis, "moe_blocks", None)) and hasattr(type(model.analysis), "routing_agreement")

    def layers(self, model: ModelContext) -> list[str]:
        return list(model.analysis.moe_blocks)

    def findings(self, model: ModelContext, layers: list[str]) -> list[Finding]:
        measured, threshold = model.analysis.routing_agreement, float(model.settings.routing_agreement_min)
        routers, quantized = model.analysis.routers, set(quantized_layer_names(model))
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
                results.append(self.finding(model, block, float("nan"), threshold, passed=False, message=(
                    f"block {block}: its routing was not compared (no router layer whose output a top-k over its "
                    "experts reads was found in the captured graph).")))
                continue
            value = float(entry["agreement"])
            fix = float_layers_fix(model, [router.layer]).paste()
            message = (f"block {block}: the quantized router {router.layer} keeps the float model's top-{router.top_k} "
                       f"experts for {value:.1%} of {int(entry['tokens'])} calibration tokens, below "
                       f"routing_agreement_min {threshold:g}: the others go to other experts. Routers are small: "
                       f"keep it in float, as the tools do (llm-compressor's ignore=['re:.*mlp.gate$']), with "
                       f"qmodel(..., {fix}); or lower routing_agreement_min.")
            results.append(self.finding(model, block, value, threshold, message=message, details={
                "router": router.layer, "top_k": router.top_k, "tokens": int(entry["tokens"])}))
        return results
