"""Hugging Face ``transformers`` front end: :class:`ZeroTrainer`, a ``transformers.Trainer``
that trains through the ZeRO engine, and :func:`zero`, which makes any Trainer subclass (TRL's
``SFTTrainer``, ``DPOTrainer``, ...) one. Importing it also makes a plain Trainer refuse the
``DS_STRATEGY_*`` variables it would ignore (``_unhonoured.py``). Needs the ``hf`` extra
(``pip install 'ds_strategy[hf]'``); the rest of the package never imports transformers."""

from .._extras import require_extra

require_extra("ds_strategy.hf", "hf", "transformers", "accelerate")

from ._private import install_accelerator_check  # noqa: E402
from ._unhonoured import check_trainer  # noqa: E402
from .combined import zero  # noqa: E402
from .pretrained import from_pretrained  # noqa: E402
from .trainer import ZeroTrainer  # noqa: E402

__all__ = ["ZeroTrainer", "from_pretrained", "zero"]

install_accelerator_check(check_trainer)
