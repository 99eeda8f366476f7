"""Quantizers, pt2e-style prepare with union-find sharing, calibration and fake-quant convert."""
