"""The front-end layer: what the ``lightning``, ``fabric`` and ``accelerate`` front ends do alike,
written once against the core's engines; front ends import it and the core, never each other."""
