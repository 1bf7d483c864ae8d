"""Build a model from a Hugging Face directory and load its safetensors weights (or the
GGUF file a derived directory links to: ``workers/models/gguf``).

Tensors are read one at a time (``safe_open``), so peak host memory is one tensor, and
each goes through its parameter's ``weight_loader``, which checks the shape, takes this
rank's shard and converts the dtype. HF's separate q/k/v and gate/up tensors are packed
into ``qkv_proj`` / ``gate_up_proj`` through the model's ``packed_modules_mapping``, and
a MoE model's expert tensors (per expert, or stacked) into its stacked experts through its
``expert_names`` (``workers/models/moe.py``).
"""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Literal

import torch
from safetensors import safe_open
from torch import nn
from tqdm import tqdm

from kernels import KernelOps, cpu_linear, deterministic_kernel_ops, get_kernel_ops
from workers.models import quant
from workers.models.arch_config import ArchConfig
from workers.models.base import CausalLM
from workers.models.deterministic import make_batch_invariant
from workers.models.fused_decode import attach_fused_decode
from workers.models.gguf.derive import GGUF_WEIGHTS
from workers.models.gguf.tensors import GGUFTensor
from workers.models.gguf.tensors import iter_tensors as iter_gguf_tensors
from workers.models.kv_scales import KV_SCALE_SUFFIXES, load_kv_scale
from workers.models.layers import (
    measure_linear_packing,
    pack_linear_weights,
    pack_lm_head_bfloat16,
)
from workers.models.moe import pack_expert_weights
from workers.models.parallel import ParallelContext
from workers.models.quant.experts import quantize_experts
from workers.models.registry import get_model_class

logger = logging.getLogger(__name__)

# Buffers some old checkpoints saved; recomputed here.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def load_model(
    model_dir: str | Path,
    dtype: torch.dtype,
    device: torch.device,
    parallel: ParallelContext | None = None,
    ops: KernelOps | None = None,
    pack_linear: bool | Literal["auto"] = "auto",
    quantization: str = "none",
    fused_decode: bool = True,
    deterministic: bool = False,
) -> tuple[CausalLM, ArchConfig]:
    """Build the model for ``model_dir`` on ``device`` in ``dtype`` and load its weights.

    ``parallel`` defaults to a single rank, ``ops`` to ``get_kernel_ops(device)``. On CPU,
    the linear weights are then packed for oneDNN where it takes ``dtype`` and, with
    ``pack_linear="auto"``, a timing of both on this machine finds it faster (see
    ``kernels/cpu_linear.py``; chosen here, once, and logged); ``True`` packs without
    timing (tests of the packed path), ``False`` never packs: a
    packed weight is an opaque oneDNN tensor, which indexing and comparisons refuse.
    Last, on CPU, decode steps get the C++ layer stack where it computes the model
    exactly (``workers/models/fused_decode.py``; ``fused_decode=False``: always eager).
    ``deterministic``: batch-invariant kernels (``kernels/batch_invariant.py``; CPU): the
    op set of ``deterministic_kernel_ops``, every weight packed for oneDNN where it takes
    ``dtype`` (MKL's float32 sgemm is not row-invariant), each linear probed at load
    (``workers/models/deterministic.py``); ValueError where this machine cannot give it.
    Raises ValueError for an unsupported architecture, a directory without weights, and
    missing, unexpected or wrongly shaped tensors (named in the message).
    """
    config = ArchConfig.from_model_dir(model_dir)
    spec = quant.resolve_spec(model_dir, quantization)
    if spec is not None and config.deepseek is not None:
        # MLA reads kv_b_proj's weight as per-head matrices (workers/models/mla.py), which
        # an int4-packed layer no longer has; its experts would quantize as below.
        raise ValueError(
            f"{config.architecture}: quantized weights ({spec.method}) are not supported for "
            "multi-head latent attention models yet; serve the checkpoint unquantized"
        )
    if spec is not None and config.num_experts and not spec.is_on_load:
        # Quantized on load only (quant/experts.py): no reader maps a published layout's
        # per-expert tensors (or a GGUF file's) onto the stacked experts yet.
        raise ValueError(
            f"{config.architecture}: quantized Mixture-of-Experts checkpoints ({spec.method}, "
            f"{spec.layout}) are not supported; load the unquantized checkpoint with "
            f"quantization: {spec.method} (quantized on load)"
        )
    model_cls = get_model_class(config.architecture)
    files = _weight_files(Path(model_dir))
    device = torch.device(device)
    parallel = parallel or ParallelContext()
    if parallel.expert_parallel and not config.num_experts:
        raise ValueError(
            f"expert_parallel: {config.architecture} has no experts (a dense model); "
            "expert parallelism needs a Mixture-of-Experts model"
        )
    if ops is None:
        ops = deterministic_kernel_ops(device) if deterministic else get_kernel_ops(device)
    if deterministic and pack_linear == "auto":
        # Not timed: the probe below needs oneDNN's row-invariance; the Triton kernels
        # read plain weights.
        pack_linear = not ops.is_triton
    with torch.device(device), _default_dtype(dtype):
        model = model_cls(config, parallel, ops)
    with torch.no_grad():
        if spec is None:
            load_weights(model, _iter_tensors(files), config)
        else:
            packed_modules = getattr(model, "packed_modules_mapping", ())
            with _open_checkpoint(files) as tensors:
                weights = quant.prepare(
                    model, tensors, spec, lambda name: _to_param_name(name, packed_modules)[0]
                )
                load_weights(model, weights, config)
            num_int4 = quant.finalize(model, dtype, device, use_triton=ops.is_triton)
            if config.num_experts:
                quantize_experts(model, spec.method, device, use_triton=ops.is_triton)
            logger.info("weights: %s (%s), %d int4 kernels", spec.method, spec.layout, num_int4)
            if (
                num_int4
                and device.type == "cpu"
                and dtype == torch.float32
                and cpu_linear.packing_supported(torch.bfloat16)
                and pack_lm_head_bfloat16(model)
            ):
                logger.info("LM head in bfloat16 (oneDNN), as the int4 layers compute")
        if pack_linear and device.type == "cpu" and cpu_linear.packing_supported(dtype):
            # Chosen by timing both on this machine, not by its CPU vendor.
            choice = measure_linear_packing(model) if pack_linear == "auto" else None
            if pack_linear is True or (choice is not None and choice.use_packed):
                num_packed = pack_linear_weights(model)
                num_packed += 2 * pack_expert_weights(model)  # MoE layers' w13 / w2 stacks
                logger.info(
                    "%d linear weights packed for oneDNN (%s): %s", num_packed, dtype,
                    "asked for" if choice is None else f"measured {choice.describe()}",
                )  # fmt: skip
            elif choice is not None:
                logger.info("linear weights kept for F.linear (%s): measured %s",
                            dtype, choice.describe())  # fmt: skip
        if deterministic:
            make_batch_invariant(model, dtype, use_triton=ops.is_triton)
    if fused_decode and device.type == "cpu":
        attach_fused_decode(model)
    model.eval()
    return model, config  # type: ignore[return-value]


def load_weights(
    model: nn.Module,
    weights: Iterator[tuple[str, torch.Tensor | CheckpointTensor]],
    config: ArchConfig,
) -> None:
    """Copy checkpoint tensors (HF names) into ``model``'s parameters; mutates the model."""
    params = dict(model.named_parameters())
    packed: tuple[tuple[str, str, str | int], ...] = getattr(model, "packed_modules_mapping", ())
    is_other_stage = getattr(model, "is_other_stage_weight", lambda name: False)
    experts = getattr(model, "expert_names", None)  # MoE models: workers/models/moe.py
    # A last pipeline stage without the first one: its LM head is loaded from the tied
    # embedding (the checkpoint's only copy).
    tied_head_alone = (
        config.tie_word_embeddings
        and "lm_head.weight" in params
        and "model.embed_tokens.weight" not in params
    )
    loaded: set[str] = set()
    unexpected: list[str] = []
    for name, tensor in weights:
        if name.endswith(_IGNORED_SUFFIXES):
            continue
        if name.endswith(KV_SCALE_SUFFIXES):  # static FP8 KV-cache scales: not parameters
            load_kv_scale(model, name, tensor)
            continue
        if name == "lm_head.weight" and config.tie_word_embeddings:
            continue  # tied: the embedding is the output projection
        if tied_head_alone and name == "model.embed_tokens.weight":
            name = "lm_head.weight"
        elif is_other_stage(name):
            continue  # never read: CheckpointTensor reads lazily
        mapped = None if experts is None else experts.to_param(name)
        if mapped is None:
            param_name, shard_id = _to_param_name(name, packed)
            covered: tuple[str, ...] = (name,)
        else:  # a stacked experts tensor counts as every per-expert tensor it holds
            param_name, shard_id, covered = mapped
        param = params.get(param_name)
        if param is None:
            unexpected.append(name)
            continue
        try:
            param.weight_loader(param, tensor, shard_id)  # type: ignore[attr-defined]
        except ValueError as e:
            raise ValueError(f"checkpoint tensor {name!r}: {e}") from None
        loaded.update(covered)
    expected = _expected_names(params, packed)
    if experts is not None:
        expected = experts.expected(expected)
    missing = sorted(expected - loaded)
    problems = []
    if missing:
        problems.append(f"missing tensors: {_short_list(missing)}")
    if unexpected:
        problems.append(f"unexpected tensors: {_short_list(sorted(unexpected))}")
    if problems:
        raise ValueError(
            f"checkpoint does not match {type(model).__name__}: " + "; ".join(problems)
        )


def _to_param_name(
    name: str, packed: tuple[tuple[str, str, str | int], ...]
) -> tuple[str, str | int | None]:
    for param_part, ckpt_part, shard_id in packed:
        if f".{ckpt_part}." in name:
            return name.replace(f".{ckpt_part}.", f".{param_part}."), shard_id
    return name, None


def _expected_names(
    params: dict[str, nn.Parameter], packed: tuple[tuple[str, str, str | int], ...]
) -> set[str]:
    """The checkpoint names that together fill every parameter."""
    names = set()
    for param_name in params:
        parts = [(p, c) for p, c, _ in packed if f".{p}." in param_name]
        if parts:
            names.update(param_name.replace(f".{p}.", f".{c}.") for p, c in parts)
        else:
            names.add(param_name)
    return names


def _weight_files(model_dir: Path) -> list[Path]:
    gguf_file = model_dir / GGUF_WEIGHTS
    if gguf_file.exists():  # a GGUF file's derived directory (workers/models/gguf/derive.py)
        return [gguf_file]
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
        return [model_dir / f for f in sorted(set(weight_map.values()))]
    single = model_dir / "model.safetensors"
    if single.is_file():
        return [single]
    raise ValueError(
        f"no weights found in {model_dir}: expected model.safetensors or "
        "model.safetensors.index.json"
    )


class CheckpointTensor:
    """A checkpoint tensor read lazily: a tensor-parallel rank reads only its shard.

    Offers what the weight loaders use of a tensor (``shape``, ``narrow``, slicing the
    first dimension, ``[:]`` for all of it); each returns a real tensor with just those
    elements, read from the file. ``elements_read`` counts them.
    """

    def __init__(self, file_slice) -> None:
        self._slice = file_slice
        self.shape = torch.Size(file_slice.get_shape())
        self.elements_read = 0

    def narrow(self, dim: int, start: int, length: int) -> torch.Tensor:
        index = [slice(None)] * len(self.shape)
        index[dim] = slice(start, start + length)
        return self[tuple(index)]

    def __getitem__(self, key) -> torch.Tensor:
        tensor = self._slice[key]
        self.elements_read += tensor.numel()
        return tensor


def _iter_tensors(files: list[Path]) -> Iterator[tuple[str, CheckpointTensor | GGUFTensor]]:
    """Every checkpoint tensor, lazily, with a progress bar on a terminal (loading a large
    model takes minutes; off in a worker process, whose stderr is a log)."""
    if files[0].name == GGUF_WEIGHTS:
        yield from _gguf_tensors(files[0])
        return
    total = 0
    for path in files:  # headers only: cheap
        with safe_open(path, framework="pt", device="cpu") as f:
            total += len(f.keys())
    with tqdm(total=total, desc="loading weights", unit="tensor", disable=None) as bar:
        for path in files:
            with safe_open(path, framework="pt", device="cpu") as f:
                for name in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                    yield name, CheckpointTensor(f.get_slice(name))
                    bar.update(1)


def _gguf_tensors(path: Path) -> Iterator[tuple[str, GGUFTensor]]:
    config = json.loads((path.parent / "config.json").read_text())
    tensors = list(iter_gguf_tensors(path, config))
    with tqdm(total=len(tensors), desc="loading GGUF weights", unit="tensor", disable=None) as bar:
        for item in tensors:
            yield item
            bar.update(1)


@contextlib.contextmanager
def _open_checkpoint(files: list[Path]) -> Iterator[dict[str, CheckpointTensor | GGUFTensor]]:
    """Every checkpoint tensor by name, lazily, the files open (quantized layouts need a
    layer's tensors together, wherever they sit)."""
    if files[0].name == GGUF_WEIGHTS:
        yield dict(_gguf_tensors(files[0]))
        return
    with contextlib.ExitStack() as stack:
        tensors: dict[str, CheckpointTensor] = {}
        for path in files:
            f = stack.enter_context(safe_open(path, framework="pt", device="cpu"))
            for name in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                tensors[name] = CheckpointTensor(f.get_slice(name))
        yield tensors


def _short_list(names: list[str], limit: int = 10) -> str:
    shown = ", ".join(names[:limit])
    return shown if len(names) <= limit else f"{shown}, ... ({len(names)} in all)"


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    # Parameters are created directly in the target dtype (no float32 copy of the model).
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)
