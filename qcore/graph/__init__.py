"""Captured graphs: capture with torch.export (FX as the fallback), the quantizable ops, folding, inputs."""
