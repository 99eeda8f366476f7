"""pytest-xdist support: keep each model on one worker, share captures at collection, survive crashed workers."""
