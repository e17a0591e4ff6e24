"""Pretrained Llama weights straight into ZeRO-3 shards: per-rank memory of the load against a
whole copy per rank, exactness, and a fine-tune larger than the machine with NVMe offload.

    python benchmarks/bench_pretrained.py --part load     # 1B-class Llama, fp32 files
    python benchmarks/bench_pretrained.py --part nvme     # 2.2B Llama, 2 steps, NVMe offload

Both parts first write a Llama "pretrained" checkpoint as ``save_pretrained`` lays it out
(``model-0000k-of-0000N.safetensors`` beside ``model.safetensors.index.json``, 2 GB shards,
``config.json``), one shard at a time so the writer never holds the model (N(0, 0.02) weights,
norms at one), under ``--root`` (kept between runs). Every run is 2 gloo ranks in new
processes, one CPU thread each.

``--part load``: Llama 1.1B (width 2048, 16 layers, vocabulary 32,000; fp32 files, 4.4 GB).
Per rank, the peak anonymous memory (``RssAnon``: the process's own pages) and the peak RSS
(``VmRSS``: with the file pages it maps), sampled every 2 ms, above what the process held
before the model was built, while:
  * ``load_weights``: the model built on the meta device, ``ds_strategy.initialize`` at ZeRO-3
    (fp32, AdamW, persistence threshold 0), then ``engine.load_weights(dir)``;
  * ``ZeroTrainer``: ``ZeroTrainer(model=dir)`` up to the engine built and loaded (the
    Trainer's ``on_train_begin``);
  * ``from_pretrained``: transformers' ``from_pretrained(dir)`` in every rank and one forward,
    the whole model (what a rank holds before DDP or a ZeRO wrapper that is given a built
    model; transformers maps the safetensors files, so its weights are file pages, read in at
    the forward, until training writes them).
Each is printed as a multiple of the model's fp32 bytes. The sharded loads are checked: the
weights gathered to rank 0 equal the files' tensors bit for bit, and the first loss on a fixed
batch equals plain transformers' (``from_pretrained`` in the parent process).

``--part nvme``: Llama 2.2B (32 layers), bf16 files; its fp32 Adam training state (16 bytes a
parameter: 35 GB) is more than this machine's memory. ``ds_strategy.hf.from_pretrained`` (the
meta model), ZeRO-3 with ``offload_param`` and ``offload_optimizer`` on NVMe, the weights read
into the swap files as the engine is built, then 2 AdamW steps on 64-token batches. Per rank: peak RSS (``VmHWM``, load included), seconds to load
and per step, the losses.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks._ranks import run  # noqa: E402

LOAD = {"hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16}
NVME = {"hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 32}
COMMON = {
    "vocab_size": 32000,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "max_position_embeddings": 2048,
    "tie_word_embeddings": False,
}
SEQ = 64


def _llama_config(sizes: dict[str, int], dtype: torch.dtype) -> Any:
    from transformers import LlamaConfig

    cfg = LlamaConfig(**COMMON, **sizes)
    cfg.architectures = ["LlamaForCausalLM"]
    cfg.dtype = dtype
    return cfg


def write_pretrained(out: Path, sizes: dict[str, int], dtype: torch.dtype) -> int:
    """A save_pretrained-style sharded checkpoint written a shard at a time; its parameters."""
    from safetensors.torch import save_file
    from transformers import LlamaForCausalLM

    cfg = _llama_config(sizes, dtype)
    with torch.device("meta"):
        shapes = {k: tuple(v.shape) for k, v in LlamaForCausalLM(cfg).state_dict().items()}
    total = sum(torch.Size(s).numel() for s in shapes.values())
    if (out / "model.safetensors.index.json").is_file():
        return total
    out.mkdir(parents=True, exist_ok=True)
    limit = 2 * 10**9
    shards: list[list[str]] = [[]]
    size = 0
    for name, shape in shapes.items():
        n = torch.Size(shape).numel() * dtype.itemsize
        if shards[-1] and size + n > limit:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += n
    g = torch.Generator().manual_seed(0)
    weight_map = {}
    for i, names in enumerate(shards):
        file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        tensors = {}
        for name in names:
            if "norm" in name:
                tensors[name] = torch.ones(shapes[name], dtype=dtype)
            else:
                tensors[name] = (torch.randn(shapes[name], generator=g) * 0.02).to(dtype)
            weight_map[name] = file
        save_file(tensors, str(out / file), metadata={"format": "pt"})
        del tensors
    size = sum(torch.Size(shapes[n]).numel() * dtype.itemsize for n in shapes)
    index = {"metadata": {"total_size": size}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    cfg.save_pretrained(out)
    return total


def _status_kb(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


class PeakAnon:
    """The high-water marks of ``RssAnon`` (the process's own memory) and ``VmRSS`` (with the
    file pages it maps: transformers maps safetensors files) from now on, every 2 ms."""

    def __init__(self) -> None:
        self.start = self.peak = _status_kb("RssAnon") * 1024
        self.start_rss = self.peak_rss = _status_kb("VmRSS") * 1024
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()

    def _sample(self) -> None:
        while not self._stop.wait(0.002):
            self._read()

    def _read(self) -> None:
        self.peak = max(self.peak, _status_kb("RssAnon") * 1024)
        self.peak_rss = max(self.peak_rss, _status_kb("VmRSS") * 1024)

    def stop(self) -> int:
        """Bytes of ``RssAnon`` above the start (``rss``: of ``VmRSS``)."""
        self._stop.set()
        self._thread.join()
        self._read()
        self.rss = self.peak_rss - self.start_rss
        return self.peak - self.start


def _tokens(rank: int) -> torch.Tensor:
    return torch.randint(
        0, COMMON["vocab_size"], (1, SEQ), generator=torch.Generator().manual_seed(rank)
    )


def _zero3(extra: dict[str, Any] | None = None) -> dict[str, Any]:
    zc = {"stage": 3, "stage3_param_persistence_threshold": 0, **(extra or {})}
    return {"zero_optimization": zc, "train_micro_batch_size_per_gpu": 1}


def _files_equal(full: dict[str, torch.Tensor], path: str) -> tuple[int, int]:
    """(tensors equal to the files', tensors in the files), one tensor at a time."""
    from safetensors import safe_open

    index = json.loads((Path(path) / "model.safetensors.index.json").read_text())["weight_map"]
    equal = 0
    for file in sorted(set(index.values())):
        with safe_open(str(Path(path) / file), "pt") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open has no __iter__
                equal += int(torch.equal(full[name], f.get_tensor(name).float()))
    return equal, len(index)


def _load_rank(rank: int, world: int, path: str, how: str) -> dict[str, Any]:
    from transformers import LlamaForCausalLM

    import ds_strategy
    from ds_strategy.hf import from_pretrained

    t0 = time.perf_counter()
    peak = PeakAnon()
    out: dict[str, Any] = {}
    if how == "from_pretrained":
        model = LlamaForCausalLM.from_pretrained(path, dtype=torch.float32)
        with torch.no_grad():  # the weights it maps are read in once used
            model(input_ids=_tokens(0))
        out["peak"] = peak.stop()
        out["rss"] = peak.rss
        out["seconds"] = time.perf_counter() - t0
        del model
        return out
    if how == "load_weights":
        model = from_pretrained(path)  # the meta model, marked for the engine
        opt = lambda ps: torch.optim.AdamW(ps, lr=1e-5)  # noqa: E731
        engine = ds_strategy.initialize(model, opt, _zero3())
    else:
        engine = _trainer_engine(path)
    out["peak"] = peak.stop()
    out["rss"] = peak.rss
    out["seconds"] = time.perf_counter() - t0
    with torch.no_grad():
        tokens = _tokens(0)
        out["loss"] = engine(input_ids=tokens, labels=tokens).loss.item()
    full = engine.full_state_dict(rank0_only=True)
    if rank == 0:
        out["equal"] = _files_equal(full, path)
    return out


def _trainer_engine(path: str) -> Any:
    """ZeroTrainer(model=dir), stopped once its engine is built and loaded."""
    from transformers import TrainerCallback, TrainingArguments

    from ds_strategy.hf import ZeroTrainer

    class Built(Exception):
        pass

    class Stop(TrainerCallback):
        def on_train_begin(self, *args: Any, **kwargs: Any) -> None:
            raise Built

    data = [{"input_ids": _tokens(i)[0], "labels": _tokens(i)[0]} for i in range(4)]
    args = TrainingArguments(
        output_dir=tempfile.mkdtemp(),
        per_device_train_batch_size=1,
        max_steps=1,
        report_to=[],
        use_cpu=True,
        disable_tqdm=True,
        save_strategy="no",
    )
    os.environ.setdefault("LOCAL_WORLD_SIZE", os.environ["WORLD_SIZE"])
    config = _zero3()
    del config["train_micro_batch_size_per_gpu"]
    trainer = ZeroTrainer(
        model=path, args=args, train_dataset=data, config=config, callbacks=[Stop()]
    )
    with contextlib.suppress(Built):
        trainer.train()
    return trainer.accelerator.zero_engine


def part_load(root: Path) -> None:
    from transformers import LlamaForCausalLM

    path = root / "llama-1.2b-fp32"
    params = write_pretrained(path, LOAD, torch.float32)
    fp32 = params * 4
    plain = LlamaForCausalLM.from_pretrained(path, dtype=torch.float32)
    with torch.no_grad():
        expect = plain(input_ids=_tokens(0), labels=_tokens(0)).loss.item()
    del plain
    print(f"Llama {params / 1e9:.2f}B parameters, fp32 files {fp32 / 1e9:.2f} GB; 2 ranks, ZeRO-3")
    head = f"{'load':<16}{'peak anon / rank':>17}{'x fp32':>8}{'peak RSS / rank':>16}{'x fp32':>8}"
    print(f"{head}{'seconds':>9}  check")
    for how in ("load_weights", "ZeroTrainer", "from_pretrained"):
        res = run(_load_rank, 2, str(path), how)
        peak = max(r["peak"] for r in res.values())
        rss = max(r["rss"] for r in res.values())
        secs = max(r["seconds"] for r in res.values())
        check = ""
        if how != "from_pretrained":
            equal, total = res[0]["equal"]
            gap = abs(res[0]["loss"] - expect)
            check = f"{equal}/{total} tensors bit-equal; first loss {res[0]['loss']:.6f} vs transformers {expect:.6f} (|d| {gap:.1e})"
        cells = f"{peak / 1e9:>14.2f} GB{peak / fp32:>8.2f}{rss / 1e9:>13.2f} GB{rss / fp32:>8.2f}"
        print(f"{how:<16}{cells}{secs:>9.1f}  {check}")


def _nvme_rank(rank: int, world: int, path: str, swap: str, steps: int) -> dict[str, Any]:
    import ds_strategy
    from ds_strategy.hf import from_pretrained

    Path("/proc/self/clear_refs").write_text("5")
    t0 = time.perf_counter()
    model = from_pretrained(path)
    nvme = {"device": "nvme", "nvme_path": swap}
    config = _zero3({"offload_param": dict(nvme), "offload_optimizer": dict(nvme)})
    engine = ds_strategy.initialize(model, lambda ps: torch.optim.AdamW(ps, lr=1e-5), config)
    out: dict[str, Any] = {"load_s": time.perf_counter() - t0, "losses": [], "step_s": []}
    for i in range(steps):
        t0 = time.perf_counter()
        tokens = _tokens(rank * 100 + i)
        loss = engine(input_ids=tokens, labels=tokens).loss
        engine.backward(loss)
        engine.step()
        out["losses"].append(loss.item())
        out["step_s"].append(time.perf_counter() - t0)
    out["peak_rss"] = _status_kb("VmHWM") * 1024
    engine.destroy()
    return out


def part_nvme(root: Path, swap: str, steps: int) -> None:
    path = root / "llama-2.2b-bf16"
    params = write_pretrained(path, NVME, torch.bfloat16)
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    print(
        f"Llama {params / 1e9:.2f}B parameters (bf16 files); fp32 Adam training state "
        f"{16 * params / 1e9:.1f} GB, this machine's memory {mem / 1e9:.1f} GB; 2 ranks, ZeRO-3, "
        "parameters and optimizer state on NVMe"
    )
    res = run(_nvme_rank, 2, str(path), swap, steps, timeout=7200)
    for rank, r in sorted(res.items()):
        steps_s = ", ".join(f"{s:.0f}" for s in r["step_s"])
        losses = ", ".join(f"{v:.4f}" for v in r["losses"])
        print(
            f"rank {rank}: peak RSS {r['peak_rss'] / 2**30:.2f} GiB (load included); "
            f"build + load {r['load_s']:.0f} s; steps {steps_s} s; losses {losses}"
        )


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--part", choices=["load", "nvme"], default="load")
    ap.add_argument("--root", default=os.path.join(tempfile.gettempdir(), "ds-pretrained"))
    ap.add_argument("--nvme-path", default=None, help="default: a temporary directory")
    ap.add_argument("--steps", type=int, default=2)
    args = ap.parse_args()
    root = Path(args.root)
    if args.part == "load":
        part_load(root)
    else:
        swap = args.nvme_path or tempfile.mkdtemp(prefix="ds-pretrained-swap-")
        part_nvme(root, swap, args.steps)


if __name__ == "__main__":
    main()
