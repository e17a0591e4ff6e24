"""Optimizers DeepSpeed configs name that ``torch.optim`` lacks: ``Lamb`` (DeepSpeed's
``FusedLamb``, correct under ZeRO), ``Adam`` (``FusedAdam``'s ``bias_correction=False``) and
the 1-bit optimizers ``OneBitAdam``, ``OneBitLamb`` and ``ZeroOneAdam`` (their compressed
exchanges run in the engine, ``core/compression``); ``Muon`` (Muon for the matrices, AdamW for
the rest), which the engine gives whole matrices (``muon.py``).

An optimizer whose update needs whole-parameter norms implements ``NeedsParamNorms``; the ZeRO
wrapper then gives it a ``ParamNorms`` (see ``norms.py``).
"""

from .adam import Adam
from .lamb import Lamb
from .muon import Muon, NeedsWholeMatrices, WholeMatrices
from .norms import NeedsParamNorms, ParamNorms
from .onebit import CompressedExchange, MomentumCompressed, OneBitAdam, OneBitLamb
from .zeroone import ZeroOneAdam

__all__ = [
    "Adam",
    "CompressedExchange",
    "Lamb",
    "MomentumCompressed",
    "Muon",
    "NeedsWholeMatrices",
    "NeedsParamNorms",
    "OneBitAdam",
    "OneBitLamb",
    "ParamNorms",
    "WholeMatrices",
    "ZeroOneAdam",
]
