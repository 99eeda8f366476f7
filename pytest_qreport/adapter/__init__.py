"""The pytest adapter: the session plugin, the collector and items of declared models, and the `qreport` fixture.
Thin layers over the core pipeline."""
