"""The front-end layer: what the front ends (``lightning``, ``fabric``, ``accelerate``) do
alike, written once against the core's public engines, which answer the same calls for saving,
loading, exporting and destroying (``ds_strategy.core.training.TrainingEngine``). Front ends import this layer and the
core, never each other; this layer imports no front end.

- ``flags``: a front end's arguments and its loop's flags (precision, accumulation,
  clipping) written into the config, contradictions refused with the value to change;
- ``engines``: building the engine (errors that name the flag at fault), the single-optimizer
  check, clip requests waiting for the step, timing sinks, checkpoint checks;
- ``lightning_base``: what Lightning's Trainer and Fabric strategies share.
"""
