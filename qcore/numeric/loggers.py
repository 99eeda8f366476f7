"""Loggers: OutputLogger stores activations like the reference; the streaming ones keep only sums."""
from __future__ import annotations

import math

import torch
from torch import nn

from qcore.numeric.metrics import sqnr_from_sums
from qcore.runtime import deferred, native

__all__ = ["ActivationStash", "ExpertsComparator", "OutputLogger", "StreamingComparator"]
_COMPARED_ELEMENTS = 1 << 20  # of a non-float32 pair compared at a time on the torch path (8 MB float64 each)


class OutputLogger(nn.Module):
    """Stores every value it sees (as torch.ao's OutputLogger does); memory grows with the batches."""

    def __init__(
        self,
        ref_node_name: str,
        prev_node_name: str,
        model_name: str,
        ref_name: str,
        prev_node_target_type: str,
        ref_node_target_type: str,
        results_type: str,
        index_within_arg: int,
        index_of_arg: int,
        fqn: str | None,
        qconfig_str: str | None = "",
    ) -> None:
        super().__init__()
        self.stats: list[torch.Tensor] = []
        self.ref_node_name = ref_node_name
        self.prev_node_name = prev_node_name
        self.model_name = model_name
        self.ref_name = ref_name
        self.prev_node_target_type = prev_node_target_type
        self.ref_node_target_type = ref_node_target_type
        self.results_type = results_type
        self.index_within_arg = index_within_arg
        self.index_of_arg = index_of_arg
        self.fqn = fqn
        self.qconfig_str = qconfig_str
        self.enabled = True
        self.save_activations = True

    def forward(self, x):
        if self.enabled and self.save_activations and isinstance(x, torch.Tensor):
            self.stats.append(x.detach().clone())  # a later in-place op (SiLU(inplace=True)) must not rewrite it
        return x

    def extra_repr(self) -> str:
        return f"model_name={self.model_name}, ref_name={self.ref_name}, results_type={self.results_type}"


class ActivationStash(nn.Module):
    """Holds the latest value only, flattened and in its own dtype, for comparators to read within the same batch:
    a comparator in another model reads `value`, one in the same graph takes the call's result as its reference
    (comparators upcast both sides themselves). copy=False holds the value itself, for a value nothing changes after
    its op ran (qcore.graph.ops.may_change_after); else a copy is overwritten by the next batch's."""

    def __init__(self, copy: bool = True) -> None:
        super().__init__()
        self.value: torch.Tensor | None = None
        self.copy = copy
        self._buffer: torch.Tensor | None = None  # reused from batch to batch: a fresh one costs page faults

    def forward(self, x):
        # copy=True: the graph may run an in-place op on x (Hardswish(inplace=True)) before a comparator reads it
        x = x.detach() if x.requires_grad else x  # detach is an op even under no_grad
        if not self.copy:
            self.value = x.reshape(-1)
            return self.value
        buffer = self._buffer
        if buffer is None or buffer.shape != x.shape or buffer.dtype != x.dtype or buffer.device != x.device:
            buffer = self._buffer = torch.empty(x.shape, dtype=x.dtype, device=x.device)
        self.value = buffer.copy_(x).view(-1)
        return self.value


class StreamingComparator(nn.Module):
    """Accumulates sum(ref^2), sum(act^2), sum(ref*act) and sum((ref-act)^2) on the device, in float64."""

    sums: torch.Tensor

    def __init__(self, stash: ActivationStash | None = None, *, actual_held: bool = False,
                 reference_held: bool = False) -> None:
        """`stash`: where the reference is read when none is given. actual_held / reference_held: that side of the
        pair stays as it is until the model call returns (a value no op changes after it ran, or a stash's, which
        the next batch overwrites), so an update queued until then holds it, not a copy of it."""
        super().__init__()
        self._stash = [stash] if stash is not None else []  # a list, so the stash is not a submodule here
        self.register_buffer("sums", torch.zeros(4, dtype=torch.float64))
        self.batches = 0
        self.actual_held, self.reference_held = actual_held, reference_held or stash is not None

    def forward(self, actual, reference=None):
        if reference is None:
            reference = self._stash[0].value
            self._stash[0].value = None
        self.add(reference, actual)
        return actual

    def add(self, reference: torch.Tensor, actual: torch.Tensor) -> None:
        """Add one batch: by the native kernel, else queued with the other comparators of the model call when one
        is open (qcore.runtime.deferred), else now. An empty pair (an expert no token was routed to) is no batch."""
        if reference.numel() == 0 and actual.numel() == 0:
            return
        if self._update_native(reference, actual):
            self.batches += 1
        elif not self._queue(reference, actual):
            self.update(reference, actual)

    def _queue(self, reference: torch.Tensor, actual: torch.Tensor) -> bool:
        """Queue copies of the pair (one the native kernel does not take) for one update with the other comparators of
        this model call (a GPU launches one chain for all of them); False leaves it to update()."""
        if not (reference.is_floating_point() and actual.is_floating_point() and reference.numel() == actual.numel()
                and self.sums.device == reference.device == actual.device and self.sums.dtype == torch.float64
                and self.sums.shape == (4,)):
            return False
        if not deferred.defer(self, _update_comparators, reference.numel(),
                              lambda: (self, _queued(reference, self.reference_held),
                                       _queued(actual, self.actual_held)), device=reference.device):
            return False
        self.batches += 1
        return True

    def update(self, reference: torch.Tensor, actual: torch.Tensor) -> None:
        """Add one batch (no host sync)."""
        if self._update_native(reference, actual):
            self.batches += 1
            return
        references, actuals = reference.detach().reshape(-1), actual.detach().reshape(-1)
        sums = self.sums.to(references.device)
        for start in range(0, references.numel(), _COMPARED_ELEMENTS):  # float64 working values stay small
            ref = references[start:start + _COMPARED_ELEMENTS].double()
            act = actuals[start:start + _COMPARED_ELEMENTS].double().to(ref.device)
            diff = ref - act
            sums = sums + torch.stack([torch.dot(ref, ref), torch.dot(act, act), torch.dot(ref, act),
                                       torch.dot(diff, diff)])
        self.sums = sums
        self.batches += 1

    def _native_takes(self, reference: torch.Tensor, actual: torch.Tensor) -> bool:
        """Whether the native kernel takes this pair (float32 CPU tensors, the kernel built)."""
        return (reference.__class__ is actual.__class__ is torch.Tensor and reference.dtype == actual.dtype ==
                torch.float32 and reference.is_cpu and actual.is_cpu and reference.numel() == actual.numel()
                and self.sums.is_cpu and self.sums.dtype == torch.float64 and self.sums.is_contiguous()
                and native.kernel() is not None)

    def _update_native(self, reference: torch.Tensor, actual: torch.Tensor) -> bool:
        """The four sums in one pass of the native kernel (float32 CPU tensors); False leaves it to torch ops."""
        if not self._native_takes(reference, actual):
            return False
        library = native.kernel()
        reference, actual = reference.detach().contiguous(), actual.detach().contiguous()
        library.qcore_compare_sums(reference.data_ptr(), actual.data_ptr(), reference.numel(),
                                   native.threads(reference.numel()), self.sums.data_ptr())
        return True

    def result(self) -> dict[str, float]:
        """sqnr_db, normalized_l2, cosine and the batch count, as plain floats (one host copy)."""
        deferred.run_pending(self)
        if self.batches == 0:  # nothing was compared: no measurement, not a perfect one
            return {"sqnr_db": math.nan, "normalized_l2": math.nan, "cosine": math.nan, "batches": 0}
        ref_sq, act_sq, dot, err_sq = self.sums.cpu().tolist()
        cosine = dot / math.sqrt(ref_sq * act_sq) if ref_sq > 0 and act_sq > 0 else (1.0 if err_sq == 0 else 0.0)
        normalized_l2 = math.sqrt(err_sq / ref_sq) if ref_sq > 0 else (0.0 if err_sq == 0 else math.inf)
        return {"sqnr_db": sqnr_from_sums(ref_sq, err_sq), "normalized_l2": normalized_l2, "cosine": cosine,
                "batches": self.batches}


def _queued(x: torch.Tensor, held: bool) -> torch.Tensor:
    """What a comparator queues of one side: x itself, flat, when it stays as it is until the flush, else a copy."""
    return deferred.flat(x) if held else deferred.flat_copy(x)


def _update_comparators(entries: list[tuple[StreamingComparator, torch.Tensor, torch.Tensor]]) -> None:
    """The queued pairs of several comparators in one chain of ops: each comparator's four float64 sums, as its own
    update adds them (summed in another order: equal to float64 rounding)."""
    groups: dict[tuple[torch.device, torch.dtype, torch.dtype], list[tuple[StreamingComparator, torch.Tensor,
                                                                          torch.Tensor]]] = {}
    for comparator, reference, actual in entries:
        groups.setdefault((reference.device, reference.dtype, actual.dtype), []).append((comparator, reference, actual))
    for (device, _, _), group in groups.items():
        references = (torch.cat([r for _, r, _ in group]) if len(group) > 1 else group[0][1]).double()
        actuals = (torch.cat([a for _, _, a in group]) if len(group) > 1 else group[0][2]).double()
        lengths = deferred.segment_lengths(device, tuple(r.numel() for _, r, _ in group))
        diff = references - actuals
        # unsafe: the lengths are the queue's own, and checking them reads them back (a host sync on a GPU); each
        # product is made as it is reduced, so one float64 product at a time is held, not four
        pairs = ((references, references), (actuals, actuals), (references, actuals), (diff, diff))
        sums = torch.stack([torch.segment_reduce(a * b, "sum", lengths=lengths, unsafe=True) for a, b in pairs], dim=1)
        torch._foreach_add_([comparator.sums for comparator, _, _ in group], list(sums.unbind(0)))


class ExpertsComparator(nn.Module):
    """A grouped projection's comparator: StreamingComparator's four float64 sums for each expert ([E, 4]), over
    the rows by expert of each batch (`counts` rows each); an expert a batch gave no row counts no batch."""

    sums: torch.Tensor
    batches: torch.Tensor

    def __init__(self, experts: int) -> None:
        super().__init__()
        self.experts = experts
        self.register_buffer("sums", torch.zeros(experts, 4, dtype=torch.float64))
        self.register_buffer("batches", torch.zeros(experts, dtype=torch.long))

    def forward(self, actual: torch.Tensor, reference: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """Add one batch of rows by expert (the reference may be flat, as a stash holds it); returns actual."""
        rows = actual.shape[0] if actual.dim() else 0
        if rows == 0:
            return actual
        lengths = counts.to(device=actual.device, dtype=torch.long)
        self.batches += (lengths > 0).to(self.batches.device)
        if self._update_native(actual, reference, lengths):
            return actual
        act = actual.detach().reshape(rows, -1).double()
        ref = reference.detach().reshape(rows, -1).to(act.device).double()
        diff = ref - act
        per_row = torch.stack([(ref * ref).sum(1), (act * act).sum(1), (ref * act).sum(1), (diff * diff).sum(1)], 1)
        self.sums += torch.segment_reduce(per_row, "sum", lengths=lengths, axis=0, unsafe=True)
        return actual

    def _update_native(self, actual: torch.Tensor, reference: torch.Tensor, lengths: torch.Tensor) -> bool:
        """Each expert's sums by the native kernel, as StreamingComparator's kernel sums the expert's rows alone
        (float32 CPU values); False leaves them to torch ops."""
        library = native.kernel()
        if not (library is not None and actual.__class__ is reference.__class__ is torch.Tensor
                and actual.dtype == reference.dtype == torch.float32 and actual.is_cpu and reference.is_cpu
                and actual.numel() == reference.numel() and self.sums.is_cpu and self.sums.is_contiguous()):
            return False
        actual, reference = actual.detach().contiguous(), reference.detach().contiguous()
        values = (lengths * (actual.numel() // actual.shape[0])).contiguous()  # each expert's values, laid in order
        library.qcore_compare_sums_by_run(reference.data_ptr(), actual.data_ptr(), values.data_ptr(), values.numel(),
                                          native.threads(native.PARALLEL_MIN_NUMEL), native.PARALLEL_MIN_NUMEL,
                                          self.sums.data_ptr())
        return True

    def results(self) -> list[dict[str, float]]:
        """Each expert's sqnr_db, normalized_l2, cosine and batch count, as StreamingComparator.result gives them
        (nan for an expert no batch reached), in expert order; one host copy."""
        found = []
        for (ref_sq, act_sq, dot, err_sq), batches in zip(self.sums.cpu().tolist(), self.batches.tolist(),
                                                          strict=True):
            if batches == 0:
                found.append({"sqnr_db": math.nan, "normalized_l2": math.nan, "cosine": math.nan, "batches": 0})
                continue
            cosine = dot / math.sqrt(ref_sq * act_sq) if ref_sq > 0 and act_sq > 0 else (1.0 if err_sq == 0 else 0.0)
            normalized_l2 = math.sqrt(err_sq / ref_sq) if ref_sq > 0 else (0.0 if err_sq == 0 else math.inf)
            found.append({"sqnr_db": sqnr_from_sums(ref_sq, err_sq), "normalized_l2": normalized_l2,
                          "cosine": cosine, "batches": batches})
        return found


class TopKAgreement(nn.Module):
    """Counts the rows (tokens) whose top-k columns (experts) are the same set in a router's output and in its
    reference, both laid out as [tokens, experts]; on the device, no host sync."""

    def __init__(self, experts: int, top_k: int) -> None:
        super().__init__()
        self.experts, self.top_k = experts, top_k
        self.agreeing: torch.Tensor | None = None
        self.tokens = 0

    def forward(self, actual: torch.Tensor, reference: torch.Tensor) -> torch.Tensor:
        if actual.numel() == 0:
            return actual
        chosen = actual.detach().reshape(-1, self.experts).topk(self.top_k, dim=-1).indices.sort(dim=-1).values
        expected = reference.detach().reshape(-1, self.experts).to(actual.dtype).topk(
            self.top_k, dim=-1).indices.sort(dim=-1).values
        agreeing = (chosen == expected).all(dim=-1).sum()
        self.agreeing = agreeing if self.agreeing is None else self.agreeing + agreeing
        self.tokens += chosen.shape[0]
        return actual

    def result(self) -> dict[str, float]:
        """{"agreement": share of tokens whose top-k agree, "tokens": how many were compared}."""
        agreeing = 0.0 if self.agreeing is None else float(self.agreeing)
        return {"agreement": agreeing / self.tokens if self.tokens else float("nan"), "tokens": float(self.tokens)}
