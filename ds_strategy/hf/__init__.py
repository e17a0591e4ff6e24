"""Hugging Face ``transformers`` front end: :class:`ZeroTrainer`, a ``transformers.Trainer``
that trains through the ZeRO engine. Needs the ``hf`` extra (``pip install
'ds_strategy[hf]'``); the rest of the package never imports transformers."""

from .._extras import require_extra

require_extra("ds_strategy.hf", "hf", "transformers", "accelerate")

from .trainer import ZeroTrainer  # noqa: E402

__all__ = ["ZeroTrainer"]
