"""``python -m ds_strategy.cli``: the ``ds-strategy`` command (under ``torchrun`` too)."""

import sys

from . import main

sys.exit(main())
