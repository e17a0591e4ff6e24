"""Demo models that the examples, the recipes and the benchmarks train (plain PyTorch: this
package imports only torch and the stdlib)."""

from ds_strategy.demos.gpt import GPT, Block, GPTConfig, KVCache, gpt_loss, init_weights

__all__ = ["GPT", "Block", "GPTConfig", "KVCache", "gpt_loss", "init_weights"]
