"""Hydra recipes on ds_strategy: ``recipes/train.py`` (Lightning) and
``recipes/train_accelerate.py`` (Accelerate) train the same character-level GPT and share the
config groups ``strategy=``, ``precision=``, ``model=``, ``data=``, ``trainer=``."""
