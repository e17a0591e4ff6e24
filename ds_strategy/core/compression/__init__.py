"""Gradient communication compression: packed 1-bit signs with error feedback, and top-k
sparsification with error feedback."""

from .onebit import compress_signs, compressed_all_reduce, decompress_signs
from .packing import pack_signs, unpack_signs
from .topk import TopK

__all__ = [
    "TopK",
    "compress_signs",
    "compressed_all_reduce",
    "decompress_signs",
    "pack_signs",
    "unpack_signs",
]
