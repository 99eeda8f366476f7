"""Number formats: torchao's integer, FP8, MX and NVFP4 numerics, and the deployed presets built on them."""
