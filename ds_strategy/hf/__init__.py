"""Hugging Face ``transformers`` front end: :class:`ZeroTrainer`, a ``transformers.Trainer``
that trains through the ZeRO engine. Needs the ``hf`` extra (``pip install
'ds_strategy[hf]'``); the rest of the package never imports transformers."""

try:
    import transformers  # noqa: F401
except ImportError as e:  # pragma: no cover - depends on the environment
    raise ImportError("ds_strategy.hf needs transformers: pip install 'ds_strategy[hf]'") from e

from .trainer import ZeroTrainer

__all__ = ["ZeroTrainer"]
