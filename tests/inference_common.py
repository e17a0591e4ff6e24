"""Models, weights on disk and corpus tokens shared by the inference tests."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import save_file

from ds_strategy.core.inference import write_model_card
from ds_strategy.demos.gpt import GPT, GPTConfig

CORPUS = Path(__file__).resolve().parent / "data" / "corpus.txt"
LLAMA_VOCAB = 128
GPT_KWARGS = dict(vocab=96, d=128, layers=2, heads=4, seq=64)  # the main job's width


def llama_config(**overrides: object):  # type: ignore[no-untyped-def]
    """A 2-layer Llama config (4 heads, 2 key-value heads, untied); ``overrides`` replace
    its sizes."""
    from transformers import LlamaConfig

    sizes = dict(
        vocab_size=LLAMA_VOCAB, hidden_size=64, intermediate_size=256, max_position_embeddings=128
    )
    return LlamaConfig(
        **{**sizes, **overrides},
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=False,
        eos_token_id=None,
        bos_token_id=None,
        pad_token_id=0,
    )


def write_llama(directory: Path) -> Path:
    """A 2-layer Llama built from a config (seeded) saved as a Hugging Face directory."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    LlamaForCausalLM(llama_config()).save_pretrained(directory)
    return directory


def write_gpt(directory: Path, **overrides: int) -> Path:
    """The demo GPT (seeded) as ``model.safetensors`` + ``ds_model.json`` with a character
    alphabet (the corpus's first characters)."""
    kwargs = {**GPT_KWARGS, **overrides}
    torch.manual_seed(0)
    model = GPT(GPTConfig(**kwargs))
    state = {k: v for k, v in model.state_dict().items() if k != "head.weight"}  # tied
    directory.mkdir(parents=True, exist_ok=True)
    save_file(state, str(directory / "model.safetensors"))
    write_model_card(
        directory, "ds_strategy.demos.gpt:GPT", kwargs, chars=alphabet(kwargs["vocab"])
    )
    return directory


def alphabet(n: int) -> str:
    chars = sorted(set(CORPUS.read_text(encoding="utf-8")))
    return "".join(chars[:n])


def corpus_tokens(vocab: int, n: int, offset: int = 0) -> torch.Tensor:
    """``n`` tokens of the corpus: characters mapped into ``vocab`` ids (by code point)."""
    text = CORPUS.read_text(encoding="utf-8")[offset : offset + n]
    return torch.tensor([ord(c) % vocab for c in text])


def corpus_windows(vocab: int, rows: int, length: int) -> torch.Tensor:
    return corpus_tokens(vocab, rows * length).view(rows, length)
