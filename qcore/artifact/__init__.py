"""A user's quantized model (the artifact it ships, from torchao, llm-compressor/compressed-tensors or ModelOpt)
measured against its float reference, layer by layer by module name, in eager mode."""
from qcore.artifact.analysis import OUTPUT_METRICS, ArtifactAnalysis, ArtifactFix, tool_recipes
from qcore.artifact.blockwise import BlockwiseArtifactError, artifact_stack, measure_artifact_blockwise
from qcore.artifact.layers import ArtifactLayer, ArtifactMismatchError, artifact_layers, state_digest
from qcore.artifact.measure import ArtifactError, ArtifactMeasurement, measure_artifact

__all__ = ["OUTPUT_METRICS", "ArtifactAnalysis", "ArtifactError", "ArtifactFix", "ArtifactLayer", "ArtifactMeasurement",
           "ArtifactMismatchError", "BlockwiseArtifactError", "artifact_layers", "artifact_stack", "measure_artifact",
           "measure_artifact_blockwise", "state_digest", "tool_recipes"]
