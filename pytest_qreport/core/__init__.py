"""The gate's core, free of pytest's collection machinery: declarations, the settings schema, findings, the check
registry, baselines, quantizer names and the model pipeline (declared -> collected -> analysed -> judged)."""
