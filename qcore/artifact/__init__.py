"""A user's quantized model (the artifact it ships, from torchao, llm-compressor/compressed-tensors, ModelOpt,
bitsandbytes, quanto, HQQ or GPTQModel) measured against its float reference, layer by layer by module name, in
eager mode; several artifacts of one reference in one pass."""
from qcore.artifact.analysis import OUTPUT_METRICS, ArtifactAnalysis, ArtifactFix, ArtifactGroup, tool_recipes
from qcore.artifact.blockwise import (
    BlockwiseArtifactError,
    artifact_stack,
    measure_artifact_blockwise,
    measure_artifacts_blockwise,
)
from qcore.artifact.layers import ArtifactLayer, ArtifactMismatchError, artifact_layers, state_digest
from qcore.artifact.measure import ArtifactError, ArtifactMeasurement, ArtifactRun, measure_artifact, measure_artifacts

__all__ = ["OUTPUT_METRICS", "ArtifactAnalysis", "ArtifactError", "ArtifactFix", "ArtifactGroup", "ArtifactLayer",
           "ArtifactMeasurement", "ArtifactMismatchError", "ArtifactRun", "BlockwiseArtifactError", "artifact_layers",
           "artifact_stack", "measure_artifact", "measure_artifact_blockwise", "measure_artifacts",
           "measure_artifacts_blockwise", "state_digest", "tool_recipes"]
