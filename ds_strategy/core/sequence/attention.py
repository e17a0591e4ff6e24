"""Attention over a sequence split across ranks: Ulysses over the sequence-parallel group,
ring attention over the context-parallel group, or both.

[Note: where attention is redirected]
A model does not know its sequence is split. While the engine runs a split forward (or the
backward that recomputes it under activation checkpointing), two redirections are in place
(``parallel.py`` says when):

- ``torch.nn.functional.scaled_dot_product_attention`` (the demo GPT, any model calling it
  directly): the module's attribute is swapped, as torch's context parallelism does (a
  ``TorchFunctionMode`` would be off inside its own handler, so inside ``Tensor.backward``
  too, where checkpointed blocks are recomputed);
- transformers' attention interface: the function registered under the model's
  ``attn_implementation`` (``"sdpa"``, ``"eager"``, ``"flex_attention"``) is swapped for ours.
  The mask transformers built for the local tokens is dropped: attention is causal over the
  whole sequence, which is what it encodes for unpadded sequences (padding is refused when the
  batch is split).

Both land in :meth:`SequenceAttention.__call__`. With sequence parallelism (``sp``), queries,
keys and values go from "my tokens, every head" to "every token, my heads" (``exchange.py``),
attention runs on whole sequences, and the output goes back. With context parallelism (``cp``)
the whole sequences are ``cp`` blocks, one per rank of the ring (``ring.py``). With both,
Ulysses runs inside each ring block: rank ``(c, s)`` holds token block ``c * sp + s``.

Grouped-query attention with fewer key/value heads than ``sp`` replicates each key/value head
``sp / Hkv`` times before the exchange, so every rank gets the one its query heads use (their
gradients sum back through the replication).
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch.nn import functional as F

from ...config import ConfigError
from ..collectives import Comm
from .exchange import heads_to_seq, seq_to_heads
from .ring import ring_attention

__all__ = ["SequenceAttention"]

_SDPA = F.scaled_dot_product_attention  # torch's own, whatever is patched in later
# what transformers' attention functions take that changes the result and is not handled here
_UNSUPPORTED_HF = ("sliding_window", "softcap", "s_aux", "sinks")


@dataclass
class SequenceAttention:
    """Attention of this rank's tokens against the whole sequence.

    Args:
        sp: the sequence-parallel (Ulysses) group.
        cp: the context-parallel (ring) group.
        wire_dtype: the all-to-all's dtype (``seq_parallel_communication_data_type``).
    """

    sp: Comm
    cp: Comm
    wire_dtype: torch.dtype | None = None
    enabled: bool = False  # the tokens at hand are this rank's block: redirect attention

    def __call__(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        *,
        causal: bool = True,
        scale: float | None = None,
        dropout_p: float = 0.0,
    ) -> torch.Tensor:
        """``[B, H, s, D]`` queries (``[B, Hkv, s, D]`` keys, values) of this rank's tokens to
        their ``[B, H, s, D]`` attention output.

        Args:
            q: this rank's queries.
            k: this rank's keys.
            v: this rank's values.
            causal: attend to earlier tokens only.
            scale: the scores' factor; None: ``1 / sqrt(D)``.
            dropout_p: attention dropout (Ulysses alone; ring attention has none).
        """
        p = self.sp.world_size
        if p > 1:
            k, v = self._kv_for_ulysses(q.shape[1], k, v)
            q, k, v = (seq_to_heads(t, self.sp, self.wire_dtype) for t in (q, k, v))
        if self.cp.world_size > 1:
            if dropout_p:
                raise ConfigError(
                    "context parallelism: attention dropout is not supported by ring attention; "
                    "set the model's attention dropout to 0",
                    key="context_parallel_size",
                )
            out = ring_attention(q, k, v, self.cp, causal=causal, scale=scale)
        else:
            gqa = k.shape[1] != q.shape[1]
            out = _SDPA(q, k, v, dropout_p=dropout_p, is_causal=causal, scale=scale, enable_gqa=gqa)
        return heads_to_seq(out, self.sp, self.wire_dtype) if p > 1 else out

    def _kv_for_ulysses(
        self, heads: int, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        p, kv_heads = self.sp.world_size, k.shape[1]
        if heads % p or (kv_heads % p and p % kv_heads):
            raise ConfigError(
                f"sequence_parallel_size={p}: Ulysses splits the attention heads across the "
                f"sequence-parallel ranks, and this model's {heads} query / {kv_heads} key-value "
                "heads do not divide by it (query heads must, and key-value heads must divide "
                "by it or into it); choose a size that does, or split the sequence with "
                "context_parallel_size (ring attention) instead",
                key="sequence_parallel_size",
            )
        if kv_heads % p:
            return k.repeat_interleave(p // kv_heads, 1), v.repeat_interleave(p // kv_heads, 1)
        return k, v

    # -- the redirections (see the note) ------------------------------------------------------

    def sdpa_redirected(self) -> contextlib.AbstractContextManager[None]:
        """Inside, ``scaled_dot_product_attention`` goes through this object while
        ``enabled``."""
        return _sdpa_patched(self)

    @contextlib.contextmanager
    def hf_redirected(self) -> Iterator[None]:
        """Inside, transformers' attention functions are this object's."""
        registry = _hf_registry()
        if registry is None:
            yield
            return
        saved = dict(registry._local_mapping)
        try:
            for name in ("sdpa", "eager", "flex_attention"):
                registry[name] = self._hf_attention
            yield
        finally:
            registry._local_mapping.clear()
            registry._local_mapping.update(saved)

    def _hf_attention(
        self,
        module: torch.nn.Module,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: Any,
        dropout: float = 0.0,
        scaling: float | None = None,
        is_causal: bool | None = None,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, None]:
        """transformers' attention function signature; output ``[B, s, H, D]``."""
        used = [name for name in _UNSUPPORTED_HF if kwargs.get(name) is not None]
        if used:
            raise ConfigError(
                f"sequence parallelism: {type(module).__name__} uses {', '.join(used)}, which "
                "the sequence-parallel attention does not implement; train this model without "
                "sequence_parallel_size / context_parallel_size",
                key="sequence_parallel_size",
            )
        causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
        out = self(query, key, value, causal=causal, scale=scaling, dropout_p=dropout)
        return out.transpose(1, 2).contiguous(), None


def _hf_registry() -> Any:
    """transformers' attention registry, when transformers is in use (never imported here)."""
    modeling = sys.modules.get("transformers.modeling_utils")
    return getattr(modeling, "ALL_ATTENTION_FUNCTIONS", None)


@contextlib.contextmanager
def _sdpa_patched(attention: SequenceAttention) -> Iterator[None]:
    """``F.scaled_dot_product_attention`` is ours inside (while ``attention.enabled``); the
    module attribute is what callers look up at each call, as torch's own context parallelism
    does."""

    def redirected(
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attn_mask: torch.Tensor | None = None,
        dropout_p: float = 0.0,
        is_causal: bool = False,
        scale: float | None = None,
        enable_gqa: bool = False,
    ) -> torch.Tensor:
        if not attention.enabled:
            return _SDPA(query, key, value, attn_mask, dropout_p, is_causal, scale=scale,
                         enable_gqa=enable_gqa)  # fmt: skip
        if attn_mask is not None:
            raise ConfigError(
                "sequence parallelism: scaled_dot_product_attention was given an attn_mask; a "
                "split sequence attends causally (is_causal=True) or to every token, without a "
                "mask",
                key="sequence_parallel_size",
            )
        return attention(query, key, value, causal=is_causal, scale=scale, dropout_p=dropout_p)

    F.scaled_dot_product_attention = redirected
    try:
        yield
    finally:
        F.scaled_dot_product_attention = _SDPA
