"""Float-equivalent rewrites: input-weight and cross-layer equalization, SmoothQuant-style smoothing."""
