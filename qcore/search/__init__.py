"""Searches over quantized configurations: layer sensitivity, the float_layers and format fixes."""
