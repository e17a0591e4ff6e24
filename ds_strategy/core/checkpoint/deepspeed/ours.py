"""One of our checkpoints read in one process, without a process group or an engine: each
parameter's weights and per-element optimizer state whole (DCP reads only that tensor's
chunks), the packed entries (counters, param groups, client state), and the saved shapes. What
an export to another layout reads (``export.py``)."""

from __future__ import annotations

from functools import cached_property
from typing import Any, cast

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from ..keys import CLIENT_STATE, ENGINE, OPTIMIZER_GROUPS, EntryKey
from ..pinned import PinnedCheckpoint
from ..records import EngineRecord
from ..store import single_process_ok
from ..trust import SafeReader, unpack
from ..validate import CheckpointError, check_files

__all__ = ["SavedCheckpoint"]


class SavedCheckpoint:
    """One of our checkpoint directories, pinned (``pinned.py``) and checked against its
    checksums."""

    def __init__(
        self,
        pinned: PinnedCheckpoint,
        trust_checkpoint: bool = False,
        require_checksums: bool = True,
    ) -> None:
        check_files(pinned, require_checksums)
        self.pinned, self.path, self.trust = pinned, pinned.path, trust_checkpoint
        self.meta = pinned.meta
        md = SafeReader(self.path, pinned=pinned).read_metadata().state_dict_metadata
        self.tensors = {k: m for k, m in md.items() if isinstance(m, TensorStorageMetadata)}

    @cached_property
    def shapes(self) -> dict[str, torch.Size]:
        """Every parameter's full shape, in the model's order."""
        return {k: torch.Size(v) for k, v in self.meta["shapes"].items()}

    def read(self, key: EntryKey | str) -> torch.Tensor:
        text = key.text if isinstance(key, EntryKey) else key
        m = self.tensors[text]
        out = torch.empty(m.size, dtype=m.properties.dtype)
        with single_process_ok(False):
            dcp.load(
                {text: out}, storage_reader=SafeReader(self.path, pinned=self.pinned), no_dist=True
            )
        return out

    def packed(self, name: str) -> object:
        return unpack(self.read(name), f"{self.path}: '{name}'", self.trust)

    @cached_property
    def engine_state(self) -> EngineRecord:
        state = self.packed(ENGINE)
        if not isinstance(state, dict):
            raise CheckpointError(f"{self.path}: its '{ENGINE}' entry is not a record")
        # unpickled as a plain dict: the record collect.py packed
        return cast(EngineRecord, state)

    @cached_property
    def client_state(self) -> object:
        return self.packed(CLIENT_STATE)

    @cached_property
    def param_groups(self) -> list[dict[str, Any]]:
        """The optimizer's param groups, each a torch param group (``param_names`` for
        ``params``)."""
        if OPTIMIZER_GROUPS not in self.tensors:
            raise CheckpointError(
                f"{self.path}: saved without optimizer state (include_optimizer=False), which "
                "a resumable export needs"
            )
        groups = self.packed(OPTIMIZER_GROUPS)
        if not isinstance(groups, list) or not all(isinstance(g, dict) for g in groups):
            raise CheckpointError(f"{self.path}: '{OPTIMIZER_GROUPS}' is not a list of groups")
        names = list(self.shapes)
        if len(groups) == 1 and "param_names" not in groups[0]:  # saved before groups were named
            groups[0]["param_names"] = [n for n in names if self.has_optimizer_state(n)]
        if any("param_names" not in g for g in groups):
            raise CheckpointError(
                f"{self.path}: {len(groups)} optimizer param groups whose parameters this "
                "checkpoint does not name (written by an older ds_strategy); save it again"
            )
        return groups

    @cached_property
    def entries(self) -> dict[str, list[EntryKey]]:
        """The per-parameter entries (weights, buffers, optimizer state) by parameter name,
        parsed once."""
        out: dict[str, list[EntryKey]] = {}
        for k in self.tensors:
            e = EntryKey.parse(k)
            if e is not None:
                out.setdefault(e.param, []).append(e)
        return out

    def has_optimizer_state(self, name: str) -> bool:
        return any(e.kind == "optim" for e in self.entries.get(name, ()))

    def weight(self, name: str) -> torch.Tensor:
        return self.read(EntryKey("model", name)).reshape(self.shapes[name]).float()

    def buffers(self) -> dict[str, torch.Tensor]:
        found = [e for keys in self.entries.values() for e in keys if e.kind == "buffer"]
        return {e.param: self.read(e) for e in found}

    def optimizer_state(self, name: str) -> dict[str, torch.Tensor]:
        """Parameter ``name``'s per-element state (flattened) and its scalar tensors."""
        kinds = ("optim", "optim_scalar")
        return {e.state: self.read(e) for e in self.entries.get(name, ()) if e.kind in kinds}
