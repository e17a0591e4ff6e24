"""Weight-only int8 / int4 quantization: the format (``scheme.py``), quantized layers and their
kernels (``modules.py``), and quantization-aware training (``qat.py``)."""

from .modules import QuantizedEmbedding, QuantizedLinear, QuantPlan, quantize_modules
from .qat import prepare_qat
from .scheme import QuantizedWeight, QuantScheme, dequantize, quantize

__all__ = [
    "QuantPlan",
    "QuantScheme",
    "QuantizedEmbedding",
    "QuantizedLinear",
    "QuantizedWeight",
    "dequantize",
    "prepare_qat",
    "quantize",
    "quantize_modules",
]
