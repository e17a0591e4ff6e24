"""An engine's sequence parallelism: its groups, the batch split and the attention redirect.

[Note: when a forward is split]
A forward is split when

- a transformers-style model (its forward takes ``input_ids``) is called with ``input_ids``
  and without ``position_ids`` or a KV cache: a forward pre-hook on that model keeps this
  rank's block of the inputs and of the shifted labels (``split.py``), and a forward hook
  makes ``output.loss`` the whole sequences' loss. Whoever calls the model (the engine,
  Lightning's ``training_step``, Accelerate's loop, transformers' Trainer) gets this;
- or the caller split the batch itself with :meth:`SequenceParallel.shard` (any model, such
  as the demo GPT, whose forward then takes ``position_ids``).

The attention redirect (``attention.py``) is on while the engine runs the forward and the
backward after it (which recomputes checkpointed blocks), as long as the last forward was
split. A call with ``position_ids`` counts as already split. A call with a KV cache
(generation) is not split, and attention runs over the tokens as given.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from ..collectives import Comm
from .attention import SequenceAttention
from .split import IGNORE_INDEX, SequenceSplit

__all__ = ["SequenceParallel"]

_CACHE_KWARGS = ("past_key_values", "cache")


class SequenceParallel:
    """Sequence (Ulysses) and context (ring) parallelism for one engine's model.

    Args:
        sp: the sequence-parallel group.
        cp: the context-parallel group.
        group: both together (``cp x sp`` ranks holding blocks of the same sequences).
        wire_dtype: the Ulysses all-to-all's dtype; None: the activations'.
    """

    def __init__(
        self, sp: Comm, cp: Comm, group: Comm, wire_dtype: torch.dtype | None = None
    ) -> None:
        self.attention = SequenceAttention(sp, cp, wire_dtype)
        self.split = SequenceSplit(group)
        self._handles: list[RemovableHandle] = []
        self._hf = contextlib.ExitStack()  # transformers' attention swapped, while split

    @property
    def active(self) -> bool:
        """The last forward was split: attention goes through the group."""
        return self.attention.enabled

    @active.setter
    def active(self, value: bool) -> None:
        self.attention.enabled = value

    @property
    def size(self) -> int:
        """How many ranks share each sequence."""
        return self.split.parts

    def shard(
        self,
        input_ids: torch.Tensor,
        labels: torch.Tensor | None = None,
        **kwargs: Any,
    ) -> dict[str, Any]:
        """This rank's block of a batch (see ``SequenceSplit.shard``); the next forward and
        backward then attend across the group.

        Args:
            input_ids: ``[B, S]`` ids of the whole sequences.
            labels: ``[B, S]`` labels aligned with them, or None.
            **kwargs: ``shift_labels``, ``attention_mask``, ``ignore_index``.
        """
        self.active = True
        return self.split.shard(input_ids, labels, **kwargs)

    def loss(
        self, logits: torch.Tensor, shift_labels: torch.Tensor, num_items: torch.Tensor
    ) -> torch.Tensor:
        """The whole sequences' mean cross-entropy from this rank's block, as ``shard`` gave
        it: the value is the whole loss, the gradient this block's share of it.

        Args:
            logits: ``[B, s, V]`` logits of this rank's tokens.
            shift_labels: ``[B, s]`` their labels (``shard``'s ``shift_labels``).
            num_items: the whole sequences' labelled tokens (``num_items_in_batch``).
        """
        summed = nn.functional.cross_entropy(
            logits.flatten(0, 1).float(),
            shift_labels.flatten(),
            ignore_index=IGNORE_INDEX,
            reduction="sum",
        )
        return self.split.combined(summed / num_items)

    def next_token_loss(
        self, model: Callable[..., torch.Tensor], tokens: torch.Tensor
    ) -> torch.Tensor:
        """The whole sequences' mean next-token loss of a model that takes ids and
        ``position_ids`` and returns logits (such as the demo GPT), from this rank's block.

        Args:
            model: the engine (or the model) to call.
            tokens: ``[B, S + 1]`` ids of whole sequences: inputs and, one further, targets.
        """
        local = self.shard(tokens[:, :-1], shift_labels=tokens[:, 1:])
        logits = model(local["input_ids"], position_ids=local["position_ids"])
        return self.loss(logits, local["shift_labels"], local["num_items_in_batch"])

    @contextlib.contextmanager
    def running(self) -> Iterator[None]:
        """Around the engine's forward and backward: attention is redirected while the
        last forward was split (see [Note: when a forward is split])."""
        try:
            with self.attention.sdpa_redirected():
                if self.active:  # a backward recomputing a split forward
                    self._swap_hf()
                yield
        finally:
            self._hf.close()

    def _swap_hf(self) -> None:
        self._hf.close()
        self._hf.enter_context(self.attention.hf_redirected())

    def attach(self, model: nn.Module) -> None:
        """Split the forwards of ``model``'s outermost transformers model (or PEFT model)
        as they are called.

        Args:
            model: the engine's model.
        """
        target = next((m for m in model.modules() if _is_causal_lm(m)), None)
        if target is None:
            return
        self._handles = [
            target.register_forward_pre_hook(self._pre_forward, with_kwargs=True),
            target.register_forward_hook(self._post_forward, with_kwargs=True),
        ]

    def detach(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    # -- the hooks ----------------------------------------------------------------------------

    def _pre_forward(
        self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
        if kwargs.get("position_ids") is not None:
            return None  # split by the caller
        ids = kwargs.get("input_ids", args[0] if args else None)
        cached = any(kwargs.get(k) is not None for k in _CACHE_KWARGS) or kwargs.get("use_cache")
        if not isinstance(ids, torch.Tensor) or ids.dim() != 2 or cached:
            self.active = False
            return None
        kwargs = dict(kwargs)
        kwargs.pop("input_ids", None)
        labels = kwargs.pop("labels", None)
        given = kwargs.pop("num_items_in_batch", None)
        split = self.shard(
            ids,
            labels,
            shift_labels=kwargs.pop("shift_labels", None),
            attention_mask=kwargs.pop("attention_mask", None),
        )
        if given is not None and "num_items_in_batch" in split:
            split["num_items_in_batch"] = given  # counted by the caller over its whole batch
        kwargs.update(split)
        kwargs["use_cache"] = False
        self._swap_hf()
        return args[1:], kwargs

    def _post_forward(
        self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any
    ) -> Any:
        self._hf.close()
        loss = getattr(output, "loss", None)
        if self.active and "shift_labels" in kwargs and isinstance(loss, torch.Tensor):
            output.loss = self.split.combined(loss)
        return output


def _is_causal_lm(module: nn.Module) -> bool:
    """A transformers model (or a PEFT model around one) whose forward takes ids and labels."""
    if not hasattr(getattr(module, "config", None), "_attn_implementation"):
        return False
    try:
        params = inspect.signature(module.forward).parameters
    except (TypeError, ValueError):
        return False
    return "input_ids" in params and "labels" in params
