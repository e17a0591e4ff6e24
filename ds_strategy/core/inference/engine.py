"""``InferenceEngine``: a model served from sharded, offloaded, quantized or tensor-parallel
weights, built without the whole model ever existing on one rank.

[Note: the four ways a rank holds the weights]
- plain: every parameter whole on every rank (each rank an independent replica);
- ZeRO-Inference (``zero_optimization.stage: 3``): every rank holds a 1/N slice of each
  block's flat parameters; each forward gathers a block just before it runs (prefetching the
  next, within ``stage3_prefetch_bucket_size``) and releases it after, so at most
  ``stage3_max_live_parameters`` elements are ever gathered; with ``offload_param`` the slices
  live on the CPU or in NVMe files between uses (ZeRO-3's own units and groups, through its
  forward-only seam ``core/zero/forward.py``);
- tensor parallelism (``tensor_parallel.autotp_size``): the training plans split each layer
  over T consecutive ranks (``tp.py``);
- quantized (``quantization.bits``): the ``nn.Linear`` / ``nn.Embedding`` weights as int8 or
  packed int4 with their scales, in any of the above (ZeRO then gathers int8 bytes).
The model is first built with its parameters on the meta device; each rank then reads from the
weights only the part it keeps (``placement.py``).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.utils._pytree import tree_map

from ...config import ConfigError, ZeroConfig, load_config
from ...config.loop import ConfigSource
from ...config.rules import Facts, check_rules
from ..checkpoint.validate import META_FILE
from ..collectives import Comm, init_process_group_from_env
from ..faults import together
from ..generation import sync_generation
from ..layout import RankLayout
from ..memory import ModelStateMeter
from ..mesh import ParallelMesh
from ..offload import Offload
from ..progress import Progress
from ..quant.modules import QuantPlan, quantize_modules, resolve_kernel
from ..quant.scheme import QuantScheme
from ..tp.plan import resolve_plan
from ..zero.forward import ForwardSharding, Unit
from ..zero.units import UnitPlan, plan_units
from .building import (
    CharTokenizer,
    DirectoryLoader,
    LoadedModel,
    ModelSpec,
    TextTokenizer,
    load_model,
)
from .generate import agreed_seed, options_problem, sample_loop
from .origins import QuantMeta, origins_for, quant_metadata
from .placement import WeightReader, place_sharded, place_whole
from .save import write_quantized
from .sources import ModuleSource, WeightSource, open_source, source_kind
from .tp import TensorParallelInference

if TYPE_CHECKING:
    from omegaconf import DictConfig

__all__ = ["InferenceEngine"]

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


class InferenceEngine(nn.Module):
    """A model ready to run: ``engine(inputs)``, ``engine.generate(...)``.

    Build it with :func:`ds_strategy.init_inference`. Under ZeRO-Inference and tensor
    parallelism, every call that runs the model is collective. Call it on every rank, the
    same number of times.

    Args:
        model: as in :func:`~ds_strategy.init_inference`.
        config: as in :func:`~ds_strategy.init_inference`.
        dtype: as in :func:`~ds_strategy.init_inference`.
        tensor_parallel: as in :func:`~ds_strategy.init_inference`.
        quantization: as in :func:`~ds_strategy.init_inference`.
        checkpoint: as in :func:`~ds_strategy.init_inference`.
        process_group: as in :func:`~ds_strategy.init_inference`.
        require_checksums: as in :func:`~ds_strategy.init_inference`.
        loaders: more kinds of model directory, each returning ``None`` for a directory it
            does not know. ``init_inference`` adds Hugging Face's.
        trust_remote_code: as in :func:`~ds_strategy.init_inference`.
    """

    def __init__(
        self,
        model: ModelSpec,
        config: ConfigSource | DictConfig = None,
        *,
        dtype: torch.dtype | str | None = None,
        tensor_parallel: int | Mapping[str, object] | None = None,
        quantization: int | Mapping[str, object] | None = None,
        checkpoint: str | os.PathLike[str] | None = None,
        process_group: torch.distributed.ProcessGroup | None = None,
        require_checksums: bool = True,
        loaders: Sequence[DirectoryLoader] = (),
        trust_remote_code: bool = False,
    ) -> None:
        super().__init__()
        init_process_group_from_env()
        self.comm = Comm(process_group)
        with together(self.comm):
            self.config = _config(config, tensor_parallel, quantization)
            self.dtype = _dtype(dtype, self.config)
            loaded = load_model(model, loaders, trust_remote_code)
            self.tokenizer = loaded.tokenizer
            where = _weights_path(loaded, checkpoint)
            kind = source_kind(where)[0] if where is not None else "module"
        source = self._open(loaded.model, where, kind, require_checksums)
        self.module = loaded.model
        self.device = _device()
        self.sharded = self.config.zero_optimization.stage == 3
        self.tensor_parallel: TensorParallelInference | None = None
        tp = self.config.tensor_parallel.autotp_size
        with together(self.comm):
            self._check_layout(tp)
        if tp > 1:  # a collective: the layout creates the tensor-parallel group
            self.tp_comm = RankLayout.over(self.comm, tp=tp).comm("tp")
        self.meter = ModelStateMeter()
        with together(self.comm):
            # the tier gives each ZeRO group its store as the group is built
            self._offload = Offload.build(self.config, [], self.comm.rank, self.comm)
            zc = self.config.zero_optimization
            self.sharding = ForwardSharding(
                self.comm,
                self.device,
                self.dtype,
                self.meter,
                zc.reduce_bucket_size,
                store=self._offload.store if self._offload is not None else None,
            )
            self.quant = self._prepare(source, tp)
            self._place(source)
        with together(self.comm):
            if self._offload is not None:
                self._offload.adopt(self.sharding.groups)
                self._offload.attach(None, META_FILE)
        if self.sharded:
            self.sharding.start(zc.stage3_prefetch_bucket_size, zc.stage3_max_live_parameters)
        source.close()
        self.module.eval()
        # engine.module.generate() too keeps the ranks in step (core/generation.py)
        sync_generation(
            self.module, collective_forward=self.sharded, world_size=self.comm.world_size
        )
        self.meter.set_resident(self._resident_bytes())

    # -- construction ---------------------------------------------------------------------------

    def _open(
        self, model: nn.Module, where: Path | None, kind: str, require_checksums: bool
    ) -> WeightSource:
        if kind in ("checkpoint", "pipeline"):  # collective: the ranks share the checksums
            assert where is not None
            return open_source(where, self.comm, require_checksums)
        source: WeightSource | None = None
        with together(self.comm):
            if kind == "module":
                source = ModuleSource.take(model)
            else:
                assert where is not None
                source = open_source(where, self.comm)
        assert source is not None
        return source

    def _check_layout(self, tp: int) -> None:
        check_rules(self.config, Facts(), "inference")  # see config/rules.py
        if tp > 1:
            ParallelMesh.data_parallel_size(self.comm.world_size, tp)

    def _prepare(self, source: WeightSource, tp: int) -> QuantPlan | None:
        """Tensor-parallel split, quantized layers, and each parameter's origin."""
        model = self.module
        splits = {}
        if tp > 1:
            plan = resolve_plan(model, tp, self.config.tensor_parallel.plan)
            self.tensor_parallel = TensorParallelInference(model, plan, self.tp_comm)
            splits = self.tensor_parallel.splits
        aliases = _aliases(model)  # before quantized layers replace the weights
        saved = quant_metadata(source)  # a quantized export's scheme and layers, checked
        quant = self._quantize(saved)
        if self.tensor_parallel is not None:
            self.tensor_parallel.install_reductions(model)
        self.origins = origins_for(model, source, splits, aliases, quant, saved is not None)
        for p in model.parameters():
            p.requires_grad_(False)
        return quant

    def _quantize(self, saved: QuantMeta | None) -> QuantPlan | None:
        """The quantized layers: those of a quantized export (``saved``, its metadata), or
        the config's."""
        qc = self.config.quantization
        if saved is not None:  # a quantized export: its scheme and layers
            scheme = QuantScheme(saved["bits"], saved["group_size"], saved["symmetric"])
            if qc.bits is not None and (qc.bits, qc.symmetric) != (scheme.bits, scheme.symmetric):
                raise ConfigError(
                    f"quantization.bits={qc.bits}, symmetric={qc.symmetric}: the weights were "
                    f"saved quantized with bits={scheme.bits}, symmetric={scheme.symmetric}; "
                    "drop the quantization section (or match it), or load full-precision "
                    "weights",
                    key="quantization.bits",
                )
            only = set(saved["modules"])
        elif qc.bits is not None:
            scheme = QuantScheme(qc.bits, qc.group_size, qc.symmetric)
            only = None
        else:
            return None
        kernel = resolve_kernel(qc.kernel, scheme)
        return quantize_modules(
            self.module,
            scheme,
            dtype=self.dtype,
            kernel=kernel,
            embeddings=qc.embeddings or only is not None,
            modules_to_not_convert=[] if only is not None else list(qc.modules_to_not_convert),
            only=only,
        )

    def _place(self, source: WeightSource) -> None:
        """The weights read into the model: whole parameters, or ZeRO-3 shards unit by unit;
        the progress of either on rank 0 (``core/progress.py``)."""
        reader = WeightReader(source)
        _load_buffers(self.module, source, self.device)
        rank = self.comm.rank
        if not self.sharded:
            params = list(self.module.parameters())
            progress = Progress("loading the weights", len(params), rank, "tensors")
            place_whole(
                params, self.module, self.origins, reader, self.device, self.dtype, progress
            )
            progress.done()
            return
        zc = self.config.zero_optimization
        plan = plan_units(self.module, zc.stage3_param_persistence_threshold)
        self._check_budget(plan)  # before reading anything
        progress = Progress("loading the weights (ZeRO-3)", len(plan.units), rank, "units")
        place_sharded(
            self.module,
            plan,
            self.origins,
            reader,
            self.sharding,
            self.device,
            self.dtype,
            progress,
        )
        progress.done()

    def _check_budget(self, plan: UnitPlan) -> None:
        budget = self.config.zero_optimization.stage3_max_live_parameters
        sizes = [sum(p.numel() for p in plan.params[id(u)]) for u in plan.units]
        root, largest = sizes[-1], max(sizes[:-1], default=0)
        # each flat group pads to a multiple of the ranks
        slack = len(sizes) * self.comm.world_size
        if root + largest + slack > budget:
            raise ConfigError(
                f"zero_optimization.stage3_max_live_parameters={budget} is below what one "
                f"forward gathers at once: the root module's {root} elements (embeddings, "
                f"final norm, head: gathered for the whole forward) plus the largest block's "
                f"{largest}, and flat groups' padding; set it to at least {root + largest + slack}",
                key="zero_optimization.stage3_max_live_parameters",
            )

    # -- running ---------------------------------------------------------------------------------

    def forward(self, *args: object, **kwargs: object) -> Any:  # the model's own output
        """The model's forward, without gradients.

        Tensors move to the engine's device; floating-point inputs are cast to its dtype.
        """
        args, kwargs = tree_map(self._to_device, (args, kwargs))
        with torch.no_grad():
            return self.module(*args, **kwargs)

    def _to_device(self, t: object) -> object:
        if not torch.is_tensor(t):
            return t
        return t.to(self.device, dtype=self.dtype if t.is_floating_point() else None)

    def generate(
        self,
        input_ids: torch.Tensor,
        max_new_tokens: int = 32,
        *,
        do_sample: bool = False,
        temperature: float = 1.0,
        top_k: int | None = None,
        top_p: float | None = None,
        seed: int | None = None,
        eos_token_id: int | None = None,
        **kwargs: object,
    ) -> torch.Tensor:
        """``input_ids`` followed by up to ``max_new_tokens`` new tokens, greedy or sampled.

        A Hugging Face causal LM generates with its own ``generate``, with its KV cache. Extra
        keyword arguments go to it. Other models use the engine's loop, with a KV cache where
        the model offers one. Collective; see ``generate.py`` for how ranks keep step.

        Args:
            input_ids: the prompt's ids, shaped (batch, tokens).
            max_new_tokens: the most tokens to add.
            do_sample: sample instead of taking the likeliest token.
            temperature: divides the logits before sampling.
            top_k: sample among the ``top_k`` likeliest tokens only.
            top_p: sample among the likeliest tokens whose probabilities sum to ``top_p``.
            seed: makes sampling repeatable.
            eos_token_id: the token that ends a sequence.

        Returns:
            ``input_ids`` followed by the new tokens, shaped (batch, tokens).
        """
        problem = self.generation_problem(
            input_ids, max_new_tokens, do_sample=do_sample, temperature=temperature,
            top_k=top_k, top_p=top_p, seed=seed,
        )  # fmt: skip
        if problem is not None:
            raise ValueError(f"generate(): {problem}")
        seed = agreed_seed(self._step_group(), seed)
        input_ids = input_ids.to(self.device)
        hf = hasattr(self.module, "generation_config") and callable(
            getattr(self.module, "generate", None)
        )
        if hf:  # its own options, passed only where given (its generation_config otherwise)
            options: dict[str, int | float | bool | None] = {
                "max_new_tokens": max_new_tokens,
                "do_sample": do_sample,
            }
            if do_sample:
                options.update(temperature=temperature, top_k=top_k, top_p=top_p)
            if eos_token_id is not None:
                options["eos_token_id"] = eos_token_id
            if self.sharded and self.comm.world_size > 1:
                options["synced_gpus"] = True
            with torch.random.fork_rng(devices=[]), torch.no_grad():
                torch.manual_seed(seed)
                generate = self.module.generate
                return generate(input_ids, **options, **kwargs)  # type: ignore[operator]
        if kwargs:
            raise TypeError(
                f"generate(): unexpected arguments {sorted(kwargs)} for {type(self.module).__name__}"
            )
        return sample_loop(
            self.forward,
            self.module,
            input_ids,
            max_new_tokens,
            do_sample=do_sample,
            temperature=temperature,
            top_k=top_k,
            top_p=top_p,
            seed=seed,
            eos_token_id=eos_token_id,
            all_done=self._all_done if self.sharded else None,
        )

    def generation_problem(
        self,
        input_ids: object,
        max_new_tokens: object,
        *,
        do_sample: bool = False,
        temperature: object = 1.0,
        top_k: object = None,
        top_p: object = None,
        seed: object = None,
        name: Callable[[str], str] = str,
    ) -> str | None:
        """What is wrong with these :meth:`generate` arguments for this model.

        Every rank checks them before any starts the loop.

        Args:
            input_ids: as in :meth:`generate`.
            max_new_tokens: as in :meth:`generate`.
            do_sample: as in :meth:`generate`.
            temperature: as in :meth:`generate`.
            top_k: as in :meth:`generate`.
            top_p: as in :meth:`generate`.
            seed: as in :meth:`generate`.
            name: spells each argument's name in the message. ``ds-strategy generate`` gives
                its options' names.

        Returns:
            The problem, or None when there is none.
        """
        ids = input_ids
        if not torch.is_tensor(ids) or ids.dim() != 2 or ids.shape[1] == 0:
            got = tuple(ids.shape) if torch.is_tensor(ids) else type(ids).__name__
            return f"{name('input_ids')} must be (batch, tokens) with a token at least, got {got}"
        if ids.dtype not in (torch.int64, torch.int32):
            return f"{name('input_ids')} must be integer token ids, got {ids.dtype}"
        vocab = self._vocab_size()
        if vocab is not None and (int(ids.min()) < 0 or int(ids.max()) >= vocab):
            return (
                f"{name('input_ids')} hold token ids outside the model's vocabulary [0, {vocab}) "
                f"(min {int(ids.min())}, max {int(ids.max())})"
            )
        problem = options_problem(
            max_new_tokens, top_k, top_p, temperature, do_sample, name=name, seed=seed
        )
        if problem is not None:
            return problem
        assert isinstance(max_new_tokens, int)  # options_problem checked it
        limit = self._max_positions()
        if limit is not None and ids.shape[1] + max_new_tokens > limit[0]:
            return (
                f"{name('max_new_tokens')}={max_new_tokens} after a prompt of {ids.shape[1]} "
                f"tokens needs {ids.shape[1] + max_new_tokens} positions; the model has "
                f"{limit[0]} ({limit[1]})"
            )
        return None

    def _max_positions(self) -> tuple[int, str] | None:
        """(positions, the config key) of a model whose positions are a fixed table: the demo
        GPT's ``seq``, GPT-2's ``n_positions``. (Rotary positions, e.g. Llama's, are not
        bounded that way, so ``max_position_embeddings`` is not a limit here.)"""
        config = getattr(self.module, "config", None)
        for key in ("seq", "n_positions"):
            value = getattr(config, key, None)
            if isinstance(value, int) and not isinstance(value, bool):
                return value, f"config.{key}"
        return None

    def _vocab_size(self) -> int | None:
        """The rows of the model's input embedding (None where it has none to ask)."""
        get = getattr(self.module, "get_input_embeddings", None)
        emb = get() if callable(get) else None
        if emb is None:
            emb = next(
                (m for m in self.module.modules() if isinstance(m, torch.nn.Embedding)), None
            )
        return int(emb.num_embeddings) if emb is not None else None

    def generate_text(
        self,
        prompt: str,
        max_new_tokens: int = 32,
        **kwargs: Any,  # generate()'s, of any type
    ) -> str:
        """``prompt`` and its continuation, through the model's tokenizer. Collective.

        The tokenizer is a Hugging Face model directory's, or a ``ds_model.json``'s character
        alphabet.

        Args:
            prompt: the text to continue.
            max_new_tokens: the most tokens to add.
            **kwargs: as in :meth:`generate`.
        """
        out = self.generate(self.encode(prompt), max_new_tokens, **kwargs)
        return self.decode(out[0].tolist())

    def encode(self, text: str) -> torch.Tensor:
        """``text`` as a (1, tokens) tensor of ids, through the model's tokenizer.

        Args:
            text: the text to encode.
        """
        return _encode(self._require_tokenizer("encode"), text)

    def decode(self, ids: list[int]) -> str:
        """Token ids as text, through the model's tokenizer (special tokens skipped).

        Args:
            ids: the token ids.
        """
        return _decode(self._require_tokenizer("decode"), ids)

    def _require_tokenizer(self, what: str) -> CharTokenizer | TextTokenizer:
        if self.tokenizer is None:
            raise ValueError(
                f"{what}: this model came without a tokenizer (a Hugging Face directory "
                "with tokenizer files, or a ds_model.json with one, has it); call generate() "
                "with token ids instead"
            )
        return self.tokenizer

    def _step_group(self) -> Comm | None:
        """The ranks whose generations must take the same steps: all of them under
        ZeRO-Inference, a tensor-parallel group, none for a plain replica."""
        if self.sharded:
            return self.comm
        return self.tensor_parallel.comm if self.tensor_parallel is not None else None

    def _all_done(self, mine: bool) -> bool:
        left = torch.tensor([0 if mine else 1])
        self.comm.all_reduce(left, kind="control")
        return int(left.item()) == 0

    # -- reports, export, teardown -----------------------------------------------------------------

    @property
    def units(self) -> list[Unit]:
        """ZeRO-Inference's units (``zero/units.py``), root last; none without it."""
        return self.sharding.units

    def _resident_bytes(self) -> int:
        groups = self.sharding.groups
        grouped = {id(p) for g in groups for p in g.params}
        whole = sum(
            p.untyped_storage().nbytes() for p in self.module.parameters() if id(p) not in grouped
        )
        shards = sum(g.resident_bytes()["params"] for g in groups)
        return whole + shards

    def memory_report(self) -> dict[str, int]:
        """Bytes this rank holds, by kind.

        Returns:
            ``params``: whole parameters and ZeRO slices. Quantized layers count at their
            stored size, scales included. ``peak``: the most held at once since the engine was
            built or :meth:`reset_peak_memory`, gathered blocks included.
            ``peak_gathered_params``: of which gathered at once. With NVMe offload,
            ``offloaded_nvme``: the bytes in files, not in ``params``.
        """
        report = {"params": self._resident_bytes(), "peak": self.meter.peak}
        elem = max((g.shard.element_size() for g in self.sharding.groups), default=0)
        report["peak_gathered_params"] = self.sharding.peak_live_numel * elem
        if self._offload is not None:  # a slice swapped out to its file holds no storage
            report.update(self._offload.report())
        return report

    def reset_peak_memory(self) -> None:
        """Start ``memory_report()``'s peaks again from the bytes held now."""
        self.meter.reset_peak()
        self.sharding.reset_peak()

    def save_quantized(self, path: str | os.PathLike[str]) -> Path:
        """Write the weights as they are held to one ``.safetensors`` file.

        Quantized layers are written as their int8 / packed int4 tensors and scales. The
        file's metadata records the quantization. :func:`ds_strategy.init_inference` loads
        the file, quantized as it is. Collective: tensor-parallel parts and ZeRO slices are
        joined first, then rank 0 writes.

        Args:
            path: the ``.safetensors`` file to write.

        Returns:
            The file written.
        """
        path = Path(path)
        if path.suffix != ".safetensors":
            raise ValueError(f"save_quantized({str(path)!r}): write a .safetensors file")
        if self.quant is None:
            raise ValueError(
                "save_quantized: this engine holds full-precision weights; build it with a "
                "quantization section (bits 8 or 4) first"
            )
        write_quantized(
            path,
            self.module,
            self.sharding.groups,
            self.comm,
            self.quant.scheme,
            self.quant.modules,
            self.tensor_parallel is not None,
        )
        return path

    def destroy(self) -> None:
        """Remove the engine's hooks and its offload swap files."""
        self.sharding.stop()
        if self._offload is not None:
            self._offload.close()


def _encode(tokenizer: CharTokenizer | TextTokenizer, text: str) -> torch.Tensor:
    if isinstance(tokenizer, CharTokenizer):
        return torch.tensor([tokenizer.encode(text)])
    return tokenizer(text, return_tensors="pt").input_ids


def _decode(tokenizer: CharTokenizer | TextTokenizer, ids: list[int]) -> str:
    if isinstance(tokenizer, CharTokenizer):
        return tokenizer.decode(ids)
    return str(tokenizer.decode(ids, skip_special_tokens=True))


def _config(
    config: ConfigSource | DictConfig,
    tensor_parallel: int | Mapping[str, object] | None,
    quantization: int | Mapping[str, object] | None,
) -> ZeroConfig:
    cfg = load_config(config)
    if tensor_parallel is not None:
        tp = (
            {"autotp_size": tensor_parallel}
            if isinstance(tensor_parallel, int)
            else tensor_parallel
        )
        cfg = cfg.replace(tensor_parallel=dict(tp))
    if quantization is not None:
        q = {"bits": quantization} if isinstance(quantization, int) else quantization
        cfg = cfg.replace(quantization=dict(q))
    # batch sizes are a training loop's: a training config's must not fail (or matter) here
    cfg = cfg.replace(
        train_batch_size=None, train_micro_batch_size_per_gpu=None, gradient_accumulation_steps=None
    )
    return cfg.resolve(world_size=1)


def _dtype(dtype: torch.dtype | str | None, cfg: ZeroConfig) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        if dtype not in _DTYPES.values():
            raise ValueError(f"dtype={dtype}: use torch.float32, torch.bfloat16 or torch.float16")
        return dtype
    if isinstance(dtype, str):
        if dtype not in _DTYPES:
            raise ValueError(f"dtype={dtype!r}: use one of {', '.join(_DTYPES)}")
        return _DTYPES[dtype]
    if cfg.fp16.enabled:
        return torch.float16
    return torch.bfloat16 if cfg.bf16.enabled else torch.float32


def _device() -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _weights_path(loaded: LoadedModel, checkpoint: str | os.PathLike[str] | None) -> Path | None:
    if checkpoint is not None:
        return Path(checkpoint)
    if loaded.weights is not None:
        return loaded.weights
    if any(p.is_meta for p in loaded.model.parameters()):
        raise ValueError(
            f"{type(loaded.model).__name__} has its parameters on the meta device and no "
            "checkpoint= was given: pass checkpoint= (a ds_strategy checkpoint, a .safetensors "
            "file or a model directory) to read the weights from"
        )
    return None


def _aliases(model: nn.Module) -> dict[str, list[str]]:
    """First name of each parameter -> every name it has (a tied weight has several)."""
    by_id: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        by_id.setdefault(id(p), []).append(name)
    return {names[0]: names for names in by_id.values()}


def _load_buffers(model: nn.Module, source: WeightSource, device: torch.device) -> None:
    """Persistent buffers found in the weights are read from them; a buffer still on the meta
    device and not in the weights cannot be recovered."""
    persistent = set(model.state_dict(keep_vars=True))
    for mod_name, m in model.named_modules():
        for name, b in list(m._buffers.items()):
            if b is None:
                continue
            full = f"{mod_name}.{name}" if mod_name else name
            if full in persistent and full in source:
                m._buffers[name] = source.read(full, slice(None)).to(device=device, dtype=b.dtype)
            elif b.is_meta:
                raise ValueError(
                    f"buffer {full!r} is on the meta device and not in the weights; build the "
                    "model with its buffers real (ds_strategy.inference builds models that way; "
                    "torch.device('meta') puts buffers there too)"
                )
            else:
                m._buffers[name] = b.to(device)
