"""Inference: sharded (ZeRO-Inference), offloaded, quantized and tensor-parallel weights
(``engine.py``), read part by part from checkpoints and safetensors files (``sources.py``)."""

from .building import CharTokenizer, load_model, write_model_card
from .engine import InferenceEngine

__all__ = ["CharTokenizer", "InferenceEngine", "load_model", "write_model_card"]
