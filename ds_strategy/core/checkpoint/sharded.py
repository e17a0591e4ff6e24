"""Sharded save and load of an engine's whole training state through
``torch.distributed.checkpoint``: every rank writes its own pieces in parallel, and a load
into another world size or ZeRO stage reads the pieces it now owns (see ``flat_piece.py``).
The engine gives its state as records (``seam.py``); ``collect.py`` turns them into what a
rank saves, ``store.py`` writes and commits it, ``reshard.py`` loads it into any layout.
This module is the format's description and the names the rest of the package uses.

Keys in the checkpoint (``<p>`` is the parameter's name in ``model.named_parameters()``):

- ``model/<p>``: the flattened parameter, as 1-D chunks from whichever ranks own them;
- ``buffer/<b>``: persistent buffers (replicated);
- ``optim/<p>/<k>``: optimizer state with one value per element (Adam's moments, momentum),
  chunked like the parameter; ``optim_scalar/<p>/<k>``: other tensors (Adam's ``step``);
  ``optim_obj/<p>/<k>``: non-tensor state, as ``trust.pack`` writes it;
- ``compression/<p>/<k>``: gradient compression's residuals, a row per rank;
- ``optim_groups``, ``engine``, ``client_state``: hyper-parameters, counters and lr-scheduler
  state, the caller's ``client_state``; ``rng/<rank>``: each rank's random state.

[Note: loading across layouts]
A pipeline saves one checkpoint per stage (``<root>/stage_<k>``), each holding its layers
under their index in the whole ``nn.Sequential``. A load may read several directories: every
key is taken from the first directory holding it (one DCP load per directory, in the same
order on every rank, each rank asking only for its own pieces), so a pipeline of another
number of stages, or a plain engine, finds its parameters wherever they were saved. A
pipeline stage's engine holds part of the model (``checkpoint_partial``): the checkpoint may
hold other layers too, only its own must be there. A weight tied across stages is saved by
each stage under its own layer's name, and by a plain engine once, under the whole model's
first name; a stage reads it under that name when its own is missing
(``checkpoint_aliases``). The counters and ``client_state`` come from the first directory;
a stage's random state from its own stage's, when the layouts match.
"""

from __future__ import annotations

from .collect import RankState, collect_state
from .reshard import load_engine
from .store import (
    CheckpointWriteError,
    commit,
    fresh_tmp,
    single_process_ok,
    total_bytes,
    write,
    write_error,
)
from .validate import FORMAT

__all__ = [
    "CheckpointWriteError",
    "FORMAT",
    "RankState",
    "collect_state",
    "commit",
    "fresh_tmp",
    "load_engine",
    "single_process_ok",
    "total_bytes",
    "write",
    "write_error",
]
