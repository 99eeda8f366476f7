"""Observers and the qparams they compute."""
