"""Counting memory from the tensors a process really holds, not from bookkeeping."""

from __future__ import annotations

import gc
import warnings

import torch

__all__ = ["live_tensor_bytes"]


def live_tensor_bytes(device_type: str | None = None) -> int:
    """Bytes of every distinct storage reachable from a live tensor, its ``.grad``, or the
    local shard of a ``DTensor``; optionally only storages on ``device_type``.

    Used by the memory tests and benchmarks to check the engine's own report against what is
    actually allocated.
    """
    gc.collect()
    storages: dict[int, int] = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # .grad of non-leaf tensors warns
        for obj in gc.get_objects():
            if not isinstance(obj, torch.Tensor):
                continue
            for t in (obj, obj.grad if obj.is_leaf else None):
                if t is None:
                    continue
                t = getattr(t, "_local_tensor", t)
                if t.device.type == "meta" or (device_type and t.device.type != device_type):
                    continue
                st = t.untyped_storage()
                if st.nbytes() > 0:
                    storages[st.data_ptr()] = st.nbytes()
    return sum(storages.values())
