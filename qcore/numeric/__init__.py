"""qcore.numeric: the FX numeric suite on qcore graphs, plus a streaming comparison."""
from qcore.numeric.compare import compare
from qcore.numeric.loggers import ActivationStash, OutputLogger, StreamingComparator
from qcore.numeric.matching import LayerMatchError, LayerPair, match_layers
from qcore.numeric.metrics import compute_cosine_similarity, compute_normalized_l2_error, compute_sqnr
from qcore.numeric.suite import (
    NSResultsType,
    add_loggers,
    add_shadow_loggers,
    extend_logger_results_with_comparison,
    extract_logger_info,
    extract_shadow_logger_info,
    extract_weights,
)

__all__ = [
    "ActivationStash", "LayerMatchError", "LayerPair", "NSResultsType", "OutputLogger", "StreamingComparator",
    "add_loggers", "add_shadow_loggers", "compare", "compute_cosine_similarity", "compute_normalized_l2_error",
    "compute_sqnr", "extend_logger_results_with_comparison", "extract_logger_info", "extract_shadow_logger_info",
    "extract_weights", "match_layers",
]
