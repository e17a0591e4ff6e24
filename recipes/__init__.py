"""Hydra recipes on ds_strategy: ``recipes/train.py`` (Lightning) and
``recipes/train_accelerate.py`` (Accelerate) train the same character-level GPT and share the
config groups ``strategy=``, ``precision=``, ``model=``, ``data=``, ``trainer=``."""

from ds_strategy._extras import require_extra

# the recipes train through Hydra, Lightning and Accelerate: the ``recipes`` extra installs them
require_extra(
    "recipes/ (the Hydra recipes, run from a checkout)",
    "recipes",
    "hydra",
    "lightning",
    "accelerate",
)
