"""Inference: sharded (ZeRO-Inference), offloaded, quantized and tensor-parallel weights
(``engine.py``), read part by part from checkpoints and safetensors files (``sources.py``)."""

from .building import CharTokenizer, ModelFileError, load_model, write_model_card
from .engine import InferenceEngine

__all__ = ["CharTokenizer", "InferenceEngine", "ModelFileError", "load_model", "write_model_card"]
