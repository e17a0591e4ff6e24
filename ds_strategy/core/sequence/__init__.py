"""Long sequences: a sequence split across ranks (Ulysses sequence parallelism, ring attention
context parallelism), composed with ZeRO, and the loss and MLPs computed over tiles of tokens. See ``parallel.py`` for what an engine does."""

from .attention import SequenceAttention
from .exchange import heads_to_seq, seq_to_heads
from .parallel import SequenceParallel
from .ring import ring_attention
from .split import IGNORE_INDEX, SequenceSplit
from .tiled import apply_tiling, tiled_cross_entropy

__all__ = [
    "IGNORE_INDEX",
    "SequenceAttention",
    "SequenceParallel",
    "SequenceSplit",
    "apply_tiling",
    "heads_to_seq",
    "ring_attention",
    "seq_to_heads",
    "tiled_cross_entropy",
]
