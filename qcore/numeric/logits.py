"""Output-level comparison of a float and a quantized model whose output is logits: KL divergence, top-1
agreement and, for causal LMs, perplexity, streamed as sums on the device (no host copy per batch).

The logits are the output leaf named "logits" (a transformers ModelOutput), else the model's only floating output
when a linear layer produces it with more than one feature (a classification or LM head). Anything else (a
regression head, embeddings) is not logits, and `LogitsComparator.result()` says why.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx
from torch.utils import _pytree as pytree

__all__ = ["LogitsComparator", "LogitsMeasurement", "logits_leaf"]

_PASS_THROUGH = ("view", "reshape", "_unsafe_view", "squeeze", "unsqueeze", "flatten", "contiguous", "clone",
                 "permute", "transpose", "getitem", "to", "_to_copy", "alias", "detach")
_POSITIONS_ELEMENTS = 1 << 20  # logits compared at a time: bounded working values for a 32k-token vocabulary


@dataclass(frozen=True)
class LogitsMeasurement:
    """Float vs quantized logits over every output position: mean KL(float || quantized) of their softmax in
    nats, the share of positions whose argmax agrees, and next-token perplexity of both (nan unless the batches
    hold input_ids and the logits are [batch, tokens, vocabulary]). `reason` says why nothing was measured."""

    kl_nats: float = math.nan
    top1_agreement: float = math.nan
    positions: int = 0
    float_perplexity: float = math.nan
    quantized_perplexity: float = math.nan
    tokens: int = 0
    leaf: str = ""
    reason: str = ""
    perplexity_reason: str = ""

    @property
    def perplexity_increase_pct(self) -> float:
        """How much higher the quantized model's perplexity is than the float model's, in %."""
        return 100.0 * (self.quantized_perplexity / self.float_perplexity - 1.0)


def _producer(node: Any) -> Any:
    """The op behind `node`, through views, copies and getitem."""
    while isinstance(node, fx.Node) and node.op == "call_function" and node.args and \
            any(name in str(node.target).split(".") for name in _PASS_THROUGH):
        node = node.args[0]
    return node


def logits_leaf(gm: fx.GraphModule | None, output: Any) -> tuple[int | None, str, str]:
    """(index among the floating output leaves, its name, "") of the logits in `output` (the model's output on a
    batch), or (None, "", why the output is not logits)."""
    from qcore.graph.ops import find_quantizable_ops

    paths, _ = pytree.tree_flatten_with_path(output)
    floating = [(pytree.keystr(path), leaf) for path, leaf in paths
                if isinstance(leaf, torch.Tensor) and leaf.is_floating_point()]
    if not floating:
        return None, "", "its output holds no floating-point tensor"
    named = [index for index, (name, _) in enumerate(floating) if "logits" in name.lower()]
    if named:
        return named[0], floating[named[0]][0] or "output", ""
    if len(floating) > 1:
        return None, "", (f"it has {len(floating)} floating outputs and none is named logits "
                          f"({', '.join(name for name, _ in floating)})")
    name, tensor = floating[0]
    if tensor.dim() < 2 or tensor.shape[-1] < 2:
        return None, "", (f"its output has shape {tuple(tensor.shape)}: a regression head or a score, not logits "
                          "over classes")
    if gm is None:  # an eager model: its one floating output of [..., classes] is taken for logits
        return 0, name or "output", ""
    node = next(n for n in gm.graph.nodes if n.op == "output").args[0]
    leaves = [leaf for leaf in pytree.tree_leaves(node) if isinstance(leaf, fx.Node)]
    heads = {op.output for op in find_quantizable_ops(gm) if op.kind in ("linear", "addmm", "matmul")}
    if len(leaves) != 1 or _producer(leaves[0]) not in heads:
        return None, "", ("its output is not produced by a linear layer (a classification or LM head), nor named "
                          "logits: embeddings or features, say")
    return 0, name or "output", ""


class LogitsComparator:
    """Streams the logits of float and quantized runs, batch by batch."""

    def __init__(self) -> None:
        self.index: int | None = None
        self.leaf, self.reason, self.perplexity_reason = "", "", ""
        self._decided = False
        self._sums: dict[str, torch.Tensor] = {}  # on the logits' device: nothing is copied to the host per batch
        self._positions = 0

    def decide(self, gm: fx.GraphModule | None, output: Any) -> None:
        """Find the logits leaf from the float model's first output (`gm`: its graph; None for an eager model)."""
        if not self._decided:
            self.index, self.leaf, self.reason = logits_leaf(gm, output)
            self._decided = True

    def _add(self, name: str, value: torch.Tensor) -> None:
        value = value.detach().to(torch.float64)
        self._sums[name] = self._sums[name] + value if name in self._sums else value

    def update(self, reference: list[torch.Tensor], actual: list[torch.Tensor], batch: Any) -> None:
        """Add one batch: the floating output leaves of the float and quantized runs, and the batch itself."""
        if self.index is None or self.index >= len(reference):
            return
        ref, act = reference[self.index].detach(), actual[self.index].detach()
        classes = ref.shape[-1] if ref.dim() else 1
        targets = self._next_tokens(ref, batch)
        rows_ref, rows_act = ref.reshape(-1, classes), act.reshape(-1, classes)
        positions = rows_ref.shape[0]
        step = max(1, _POSITIONS_ELEMENTS // max(1, classes))  # an LM's float32 working values stay a few MB
        for start in range(0, positions, step):
            part = slice(start, start + step)
            chunk_ref, chunk_act = rows_ref[part].float(), rows_act[part].float()
            self._add("agree", (chunk_ref.argmax(dim=-1) == chunk_act.argmax(dim=-1)).sum())
            log_p, log_q = torch.log_softmax(chunk_ref, dim=-1), torch.log_softmax(chunk_act, dim=-1)
            terms = log_p.exp() * (log_p - log_q)  # a class the float model rules out (-inf) adds 0, not nan
            self._add("kl", torch.where(log_p == -math.inf, 0.0, terms).sum())
            if targets is not None:
                target, keep = targets[0][part].unsqueeze(-1), targets[1][part]
                for name, logs in (("nll_float", log_p), ("nll_quantized", log_q)):
                    self._add(name, torch.where(keep, -logs.gather(-1, target)[:, 0], 0.0).sum())
        self._positions += positions
        if targets is not None:
            self._add("tokens", targets[1].sum())

    def _next_tokens(self, logits: torch.Tensor, batch: Any) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Per output position (flattened): the next token's id and whether it counts (there is one, and the
        attention mask keeps it); None, with the reason kept, when the batch or the logits are not a causal LM's."""
        ids = batch.get("input_ids") if isinstance(batch, dict) else None
        if not isinstance(ids, torch.Tensor) or logits.dim() != 3 or tuple(ids.shape) != tuple(logits.shape[:2]) \
                or ids.shape[1] < 2:
            self.perplexity_reason = ("perplexity needs a causal LM: logits [batch, tokens, vocabulary] and the "
                                      "token ids as input_ids in each batch (a dict)")
            return None
        ids = ids.to(logits.device)
        targets = torch.zeros_like(ids)
        targets[:, :-1] = ids[:, 1:]
        keep = torch.zeros(ids.shape, dtype=torch.bool, device=logits.device)
        mask = batch.get("attention_mask")
        keep[:, :-1] = (mask[:, 1:].to(logits.device) != 0) if isinstance(mask, torch.Tensor) and \
            mask.shape == ids.shape else True
        return targets.reshape(-1), keep.reshape(-1)

    def result(self) -> LogitsMeasurement:
        """The measurement over every batch so far (one host copy, here)."""
        if self.index is None:
            return LogitsMeasurement(reason=self.reason or "the model was not run")
        sums = {name: float(value) for name, value in self._sums.items()}
        positions = self._positions
        if not positions:
            return LogitsMeasurement(leaf=self.leaf, reason="no batch was compared")
        tokens = int(sums.get("tokens", 0))
        float_ppl = math.exp(sums["nll_float"] / tokens) if tokens and not self.perplexity_reason else math.nan
        quant_ppl = math.exp(sums["nll_quantized"] / tokens) if tokens and not self.perplexity_reason else math.nan
        return LogitsMeasurement(kl_nats=sums["kl"] / positions, top1_agreement=sums["agree"] / positions,
                                 positions=positions, float_perplexity=float_ppl, quantized_perplexity=quant_ppl,
                                 tokens=tokens, leaf=self.leaf, perplexity_reason=self.perplexity_reason)
