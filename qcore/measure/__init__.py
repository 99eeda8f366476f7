"""One model's measurement passes: calibration and comparison, variants, screens, block-wise analysis."""
