"""The package's logger tree: every module logs through ``logging.getLogger(__name__)``
(``ds_strategy.core.engine``, ``ds_strategy.core.timers``, ...), children of ``ds_strategy``.

[Note: a library does not configure logging]
The ``ds_strategy`` logger gets a ``NullHandler`` and nothing else, as the ``logging`` HOWTO
asks of libraries: with no configuration of the application's own, nothing is printed (not
even Python's last-resort output of warnings and errors, which a ``NullHandler`` anywhere up
the tree turns off), and the application decides what to show::

    import logging
    logging.basicConfig(level=logging.INFO, format="%(message)s")  # everything at INFO
    logging.getLogger("ds_strategy.core.progress").setLevel(logging.WARNING)  # no progress

What logs at INFO: the summary an engine gives once it is built (``ds_strategy.core.engine``),
the ``wall_clock_breakdown`` line (``ds_strategy.core.timers``) and the progress of long
operations (``ds_strategy.core.progress``), each on rank 0 only.
"""

from __future__ import annotations

import logging

logging.getLogger("ds_strategy").addHandler(logging.NullHandler())
