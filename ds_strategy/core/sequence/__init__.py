"""Long sequences: a sequence split across ranks (Ulysses sequence parallelism, ring attention
context parallelism), composed with ZeRO. See ``parallel.py`` for what an engine does."""

from .attention import SequenceAttention
from .exchange import heads_to_seq, seq_to_heads
from .parallel import SequenceParallel
from .ring import ring_attention
from .split import IGNORE_INDEX, SequenceSplit

__all__ = [
    "IGNORE_INDEX",
    "SequenceAttention",
    "SequenceParallel",
    "SequenceSplit",
    "heads_to_seq",
    "ring_attention",
    "seq_to_heads",
]
