"""The lowest layer: native C kernels (built on first use, with a torch fallback) and progress reporting."""
