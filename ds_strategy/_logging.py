"""The package's logger tree: every module logs through ``logging.getLogger(__name__)``
(``ds_strategy.core.engine``, ``ds_strategy.core.timers``, ...), children of ``ds_strategy``.

[Note: warnings show, the rest is the application's]
The package configures no logging: no handler, no level. So without a configuration of the
application's own, Python's last-resort handler prints what is logged at WARNING and above to
stderr (an fp16 step skipped on a gradient overflow, an optimizer parameter ignored, a monitor
without a batch size for its x axis), as DeepSpeed and transformers show theirs, and INFO stays
silent. Once the application configures logging, every record goes where it says::

    import logging
    logging.basicConfig(level=logging.INFO, format="%(message)s")  # everything at INFO
    logging.getLogger("ds_strategy.core.progress").setLevel(logging.WARNING)  # no progress
    logging.getLogger("ds_strategy").setLevel(logging.ERROR)  # not even the warnings

What logs at INFO: the summary an engine gives once it is built (``ds_strategy.core.engine``),
the ``wall_clock_breakdown`` line (``ds_strategy.core.timers``) and the progress of long
operations (``ds_strategy.core.progress``), each on rank 0 (a pipeline: each stage's first).
"""

from __future__ import annotations

import logging

__all__ = ["package_logger"]

package_logger = logging.getLogger("ds_strategy")  # the parent of every module's logger
