"""Group ids for 100k-node SharedQuantizationSpec chains, both directions: qcore vs torchao 0.18.

Forward chain: node i shares with node i+1 (targets come later in key order).
Backward chain: node i shares with node i-1.

    python benchmarks/bench_unionfind.py
"""
from __future__ import annotations

import sys
import time

import torch
from torch import fx

N = 100_000


def _chain(spec_module, forward: bool):
    graph = fx.Graph()
    nodes = [graph.placeholder("x")]
    for _ in range(N):
        nodes.append(graph.call_function(torch.relu, (nodes[-1],)))
    mapping = {}
    for i, node in enumerate(nodes[1:], start=1):
        node.meta["quantization_annotation"] = spec_module.QuantizationAnnotation(allow_implicit_sharing=False)
        if (forward and i == N) or (not forward and i == 1):
            mapping[node] = spec_module.QuantizationSpec(dtype=torch.int8, observer_or_fake_quant_ctr=None)
        else:
            mapping[node] = spec_module.SharedQuantizationSpec(nodes[i + 1] if forward else nodes[i - 1])
    return mapping


def _time(fn, mapping):
    start = time.perf_counter()
    try:
        ids = fn(mapping)
    except RecursionError:
        return None, "RecursionError"
    return time.perf_counter() - start, f"{len(set(ids.values()))} group(s)"


def main() -> None:
    import qcore
    from qcore.quantization.prepare import get_edge_or_node_to_group_id

    try:
        from torchao.quantization.pt2e import quantizer as ao_quantizer
        from torchao.quantization.pt2e.prepare import _get_edge_or_node_to_group_id as ao_group_ids
    except ImportError:
        ao_quantizer = ao_group_ids = None
    print(f"{N}-node sharing chains, recursion limit {sys.getrecursionlimit()}")
    for forward in (True, False):
        label = "forward " if forward else "backward"
        ours_time, ours_result = _time(get_edge_or_node_to_group_id, _chain(qcore, forward))
        line = f"{label}: qcore {ours_time:.3f} s ({ours_result})"
        if ao_group_ids is not None:
            ao_time, ao_result = _time(ao_group_ids, _chain(ao_quantizer, forward))
            line += " | torchao 0.18 " + (f"{ao_time:.3f} s ({ao_result}), ratio torchao/qcore "
                                             f"{ao_time / ours_time:.2f}" if ao_time else ao_result)
        print(line)


if __name__ == "__main__":
    main()
