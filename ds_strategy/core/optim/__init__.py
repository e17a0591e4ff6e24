"""Optimizers DeepSpeed configs name that ``torch.optim`` lacks: ``Lamb`` (DeepSpeed's
``FusedLamb``, correct under ZeRO) and ``Adam`` (``FusedAdam``'s ``bias_correction=False``).

An optimizer whose update needs whole-parameter norms implements ``NeedsParamNorms``; the ZeRO
wrapper then gives it a ``ParamNorms`` (see ``norms.py``).
"""

from .adam import Adam
from .lamb import Lamb
from .norms import NeedsParamNorms, ParamNorms

__all__ = ["Adam", "Lamb", "NeedsParamNorms", "ParamNorms"]
