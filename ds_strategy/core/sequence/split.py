"""How a batch of whole sequences becomes this rank's block of them, and how the blocks'
losses make the loss of the whole sequences.

[Note: splitting a batch]
Every rank of a sequence group (``cp x sp`` ranks, see ``attention.py``) receives the same
batch. Each keeps its block of ``S / (cp x sp)`` consecutive tokens. Three things are split
alike: the input ids, the positions (a rank's block starts at ``index x S / parts``, which
rotary embeddings and learned positions must see), and the labels *after* shifting. A causal
LM predicts token ``t + 1`` at position ``t``: shifted on the whole sequence, the label of a
block's last token is the next block's first token, which the block does not hold. The last
position of the sequence has no label (``ignore_index``).

The loss of the whole sequences is the mean over their labelled tokens. A block's loss is its
sum over its tokens divided by the count over the whole sequences (``num_items_in_batch``,
transformers' name), so the blocks' losses add up to that mean and their gradients add up
to its gradient. ``combined`` makes a block's loss read as that sum (an all-reduce of the
values) while its gradient stays the block's own. The gradient reduction then sums over the
sequence group and averages over the data-parallel ranks only (``assembly.py`` divides by
the data-parallel degree).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ...config import ConfigError
from ..collectives import Comm

__all__ = ["IGNORE_INDEX", "SequenceSplit"]

IGNORE_INDEX = -100  # transformers' and torch's cross_entropy default


@dataclass(frozen=True)
class SequenceSplit:
    """This rank's block of a batch's sequences.

    Args:
        group: the sequence group: every rank holding a block of the same sequences, in
            block order.
    """

    group: Comm

    @property
    def parts(self) -> int:
        return self.group.world_size

    @property
    def index(self) -> int:
        return self.group.rank

    def block(self, x: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """This rank's block of ``x`` along ``dim`` (the sequence dimension).

        Args:
            x: a tensor holding whole sequences along ``dim``.
            dim: the sequence dimension.
        """
        length = x.shape[dim]
        if length % self.parts:
            raise ConfigError(
                f"a sequence of {length} tokens does not split into {self.parts} equal blocks "
                "(context_parallel_size x sequence_parallel_size); pad or cut sequences to a "
                f"multiple of {self.parts}",
                key="sequence_parallel_size",
            )
        size = length // self.parts
        return x.narrow(dim, self.index * size, size)

    def positions(self, like: torch.Tensor) -> torch.Tensor:
        """The positions of this rank's tokens of ``like`` (``[B, S]`` ids): ``[B, S/parts]``.

        Args:
            like: the whole sequences' input ids.
        """
        whole = torch.arange(like.shape[1], device=like.device).expand(like.shape[0], -1)
        return self.block(whole)

    @staticmethod
    def shifted(labels: torch.Tensor, ignore_index: int = IGNORE_INDEX) -> torch.Tensor:
        """The label each position predicts: the next token's, and ``ignore_index`` last.

        Args:
            labels: ``[B, S]`` labels of the whole sequences, aligned with the inputs (as
                transformers' causal LMs take them).
            ignore_index: the label of the last position.
        """
        return torch.nn.functional.pad(labels, (0, 1), value=ignore_index)[:, 1:]

    def shard(
        self,
        input_ids: torch.Tensor,
        labels: torch.Tensor | None = None,
        *,
        shift_labels: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        ignore_index: int = IGNORE_INDEX,
    ) -> dict[str, Any]:
        """This rank's block of a causal LM's batch, as keywords of its forward.

        Returns ``input_ids`` and ``position_ids`` of the block; with labels, also the
        block's ``labels`` and ``shift_labels`` (already shifted) and ``num_items_in_batch``:
        the labelled tokens of the whole sequences.

        Args:
            input_ids: ``[B, S]`` ids of the whole sequences.
            labels: ``[B, S]`` labels aligned with ``input_ids`` (shifted here).
            shift_labels: labels already shifted (instead of ``labels``).
            attention_mask: must be all ones (a split sequence cannot be padded).
            ignore_index: the label that counts for nothing.
        """
        if attention_mask is not None and not bool(attention_mask.bool().all()):
            raise ConfigError(
                "sequence parallelism: the batch has padding (an attention_mask with zeros); "
                "a split sequence attends causally over all its tokens. Pack sequences to one "
                "length, or mark padding by labels of -100 instead",
                key="sequence_parallel_size",
            )
        out: dict[str, Any] = {
            "input_ids": self.block(input_ids).contiguous(),
            "position_ids": self.positions(input_ids).contiguous(),
        }
        if shift_labels is None and labels is not None:
            shift_labels = self.shifted(labels, ignore_index)
        if shift_labels is not None:
            local = self.block(shift_labels).contiguous()
            out.update(labels=local, shift_labels=local)
            out["num_items_in_batch"] = (shift_labels != ignore_index).sum()
        return out

    def combined(self, loss: torch.Tensor) -> torch.Tensor:
        """``loss`` reading as the sum over the group's blocks, its gradient still this
        block's (see [Note: splitting a batch]).

        Args:
            loss: this block's loss: its tokens' sum over the whole sequences' count.
        """
        if self.parts == 1:
            return loss
        total = loss.detach().clone()
        self.group.all_reduce(total, kind="control")
        return loss + (total - loss.detach())
