"""A DeepSpeed checkpoint's weights as DeepSpeed's ``zero_to_fp32.py`` gathers them, one tensor
at a time: :class:`DeepSpeedWeights` lists what the consolidated file holds and reads any one
of its tensors on request, so ``consolidate`` writes them without the whole model in memory.

[Note: what zero_to_fp32 writes]
In this order: the buffers (``buffer_names``, from the module's saved state), the frozen
parameters (``frozen_param_shapes``: whole from rank 0's ``frozen_param_fragments`` at stages
0-2, joined from every rank's at stage 3) unless they are left out, the trained parameters
(``param_shapes`` order, fp32 from the optimizer's partitions), then each tied weight's other
name (``shared_params``) whose saved name was written, with the same values. zero_to_fp32
turns every buffer to fp32; here an integer buffer (a batch norm's ``num_batches_tracked``)
stays an integer, and floating-point tensors take ``dtype`` (``None``: as saved, the trained
parameters in fp32).

[Note: one tensor at a time]
The checkpoint's files are memory-mapped (``open_deepspeed``), so listing the entries reads no
tensor data. ``read`` builds one tensor from the pages that hold it and keeps nothing: a
trained parameter is copied out of its ranks' partitions, a frozen one out of its fragments
(``frozen_param``, one at a time: the layout's ``frozen`` property joins every one), a buffer converted from the mapped module state. Peak memory is thus about one tensor
(two while it changes dtype), whatever the model's size.
"""

from __future__ import annotations

import torch

from ..weights_shards import WeightEntry
from .layout import DeepSpeedCheckpoint

__all__ = ["DeepSpeedWeights"]


class DeepSpeedWeights:
    """The consolidated weights of ``ckpt`` (see [Note: what zero_to_fp32 writes]), in
    ``dtype`` for floating-point tensors (``None``: as saved), without the frozen parameters
    when ``exclude_frozen_parameters``."""

    def __init__(
        self,
        ckpt: DeepSpeedCheckpoint,
        dtype: torch.dtype | None = torch.float32,
        exclude_frozen_parameters: bool = False,
    ) -> None:
        self.ckpt = ckpt
        self.dtype = dtype
        self._frozen_shapes = ckpt.frozen_shapes
        self._buffer_names = list(ckpt.buffers)
        self.entries = self._list(exclude_frozen_parameters)

    def _out_dtype(self, saved: torch.dtype) -> torch.dtype:
        return self.dtype if self.dtype is not None and saved.is_floating_point else saved

    def _list(self, exclude_frozen: bool) -> list[WeightEntry]:
        module = self.ckpt.model_state["module"]
        out = [
            WeightEntry(n, self._out_dtype(module[n].dtype), tuple(module[n].shape))
            for n in self._buffer_names
        ]
        if not exclude_frozen:
            out += [
                WeightEntry(n, self._out_dtype(self._fragment_dtype(n)), tuple(shape))
                for n, shape in self._frozen_shapes.items()
            ]
        fp32 = self._out_dtype(torch.float32)
        out += [WeightEntry(n, fp32, tuple(shape)) for n, shape in self.ckpt.shapes.items()]
        written = {e.name: e for e in out}
        for alias, saved in self.ckpt.shared.items():
            if saved in written and alias not in written:
                out.append(WeightEntry(alias, written[saved].dtype, written[saved].shape, saved))
        return out

    def _fragment_dtype(self, name: str) -> torch.dtype:
        return self.ckpt.model_files[0]["frozen_param_fragments"][name].dtype

    def read(self, name: str) -> torch.Tensor:
        """The tensor of entry ``name`` (a saved name, never a tied weight's other name), in
        its entry's dtype; read from the mapped files now, kept by nobody here."""
        if name in self.ckpt.shapes:  # not ckpt.full, which joins every frozen one first
            shape = self.ckpt.shapes[name]
            t = self.ckpt.read(name, 0, shape.numel()).view(shape)  # a fresh tensor
            return t.to(self._out_dtype(t.dtype))
        if name in self._frozen_shapes:
            t = self.ckpt.frozen_param(name)
        elif name in self._buffer_names:
            t = self.ckpt.model_state["module"][name]
        else:
            raise KeyError(f"{self.ckpt.directory}: {name!r} is not a saved weight or buffer")
        out = t.to(self._out_dtype(t.dtype))
        # a mapped tensor may be a view of a storage it shares with others, all of which
        # torch.save would write: the writer gets a tensor of its own
        return out.clone() if out is t else out.contiguous()
