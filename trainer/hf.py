"""Model weights in Hugging Face safetensors layout: export at the end of training, import to start from.

Export writes ``model-0000i-of-0000P.safetensors`` (one file per pipeline rank), the index
``model.safetensors.index.json`` and ``config.json``, with HF parameter names and layouts, so
``transformers.AutoModelForCausalLM.from_pretrained(folder)`` loads it.
"""

import dataclasses
import json
import logging
import math
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors import safe_open
from safetensors.torch import save_file

from trainer.config.schema import Model
from trainer.dtensor import full_tensor
from trainer.errors import UserError
from trainer.jsonfile import entry, read_json
from trainer.models import ModelSpec
from trainer.models.init import copy_full_

logger = logging.getLogger(__name__)
INDEX = "model.safetensors.index.json"


def _adapter(spec: ModelSpec):
    if spec.hf is None:
        raise UserError(f"[model] name: model family {spec.name} has no Hugging Face mapping (ModelSpec.hf)")
    return spec.hf


def is_hf_folder(path: Path) -> bool:
    return path.is_dir() and ((path / INDEX).is_file() or any(path.glob("*.safetensors")))


@torch.no_grad()
def export_hf(chunks, spec: ModelSpec, args, folder: Path, dtype: torch.dtype, *, pp_rank: int, pp: int,
              writer: bool, tokenizer=None, context: int | None = None) -> None:
    """Write this pipeline rank's weights; ``writer`` is the one rank per pipeline rank that writes. Rank 0
    also writes config.json and, given the run's ``tokenizer``, its files and generation_config.json.
    ``context``: the model's own context (``model_context``), written as max_position_embeddings where it
    exceeds the length the weights were trained at (``args``): a model fine-tuned on shorter sequences keeps it.

    Every rank must call this: gathering a sharded parameter is a collective over its mesh.
    """
    hf = _adapter(spec)
    aliases = spec.tied_aliases(args)
    parts: dict[str, dict[str, torch.Tensor]] = {}  # HF name -> {our name: its tensor}
    for chunk in chunks:
        for name, value in chunk.state_dict().items():
            full = full_tensor(value)
            if name in aliases:  # HF ties lm_head to the embedding itself (tie_word_embeddings)
                continue
            # the router's choosing bias stays float32 (transformers keeps it so; a bf16 bias can change the choice)
            keep = torch.float32 if name.endswith("router.expert_bias") else dtype
            converted = hf.to_hf(name, full.detach().to("cpu", keep), args)
            keys = hf.names(name, args)
            # One of ours may be several of theirs, stacked on dim 0 (e.g. one tensor per expert), and several of
            # ours one of theirs (joined by the adapter; they sit in one block, so in one chunk).
            for key, part in zip(keys, converted.unbind(0) if len(keys) > 1 else [converted]):
                parts.setdefault(key, {})[name] = part
    tensors = {key: (hf.join(key, p) if len(p) > 1 else next(iter(p.values()))).contiguous()
               for key, p in parts.items()}
    file = f"model-{pp_rank + 1:05d}-of-{pp:05d}.safetensors"
    if writer:
        folder.mkdir(parents=True, exist_ok=True)
        save_file(tensors, str(folder / file), metadata={"format": "pt"})
    # name -> (file, bytes) of what this rank wrote; the index lists every pipeline rank's tensors.
    written = {k: (file, t.numel() * t.element_size()) for k, t in tensors.items()} if writer else {}
    if dist.is_initialized():
        gathered = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, written)
        written = {k: v for part in gathered for k, v in part.items()}
    names = {k: f for k, (f, _) in written.items()}
    if not dist.is_initialized() or dist.get_rank() == 0:
        total = sum(size for _, size in written.values())
        (folder / INDEX).write_text(json.dumps({"metadata": {"total_size": total},
                                                "weight_map": dict(sorted(names.items()))}, indent=2))
        config = hf.config(args, dtype)
        if context and context > config.get("max_position_embeddings", context):
            config["max_position_embeddings"] = context
        if tokenizer is not None:
            tokenizer.save_hf(folder)
            ids = {"bos_token_id": tokenizer.bos_id, "eos_token_id": tokenizer.eos_id}
            config.update(ids)
            (folder / "generation_config.json").write_text(json.dumps(ids, indent=2) + "\n")
        (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        logger.info("Hugging Face export written: %s", folder)
    if dist.is_initialized():
        dist.barrier()


def model_context(spec: ModelSpec, section: Model) -> int | None:
    """The context ``[model]`` describes (its max_seq_len before the run sizes it to [training] seq_len)."""
    from trainer.models import resolve_model_args

    return getattr(resolve_model_args(spec, section), "max_seq_len", None)


_KEY = "[checkpoint] initial_load_path"


def read_hf_config(folder: Path, key: str = _KEY) -> dict:
    """A Hugging Face folder's config.json; a missing or unreadable one is one UserError naming it."""
    path = folder / "config.json"
    if not path.is_file():
        raise UserError(f"{key}: {folder} has no config.json (a Hugging Face model folder has one)")
    return read_json(path, key, what="model config")


def hf_family(config: dict, folder: Path, key: str = _KEY) -> ModelSpec:
    """The registered family whose HF class wrote this config.json (by ``model_type``)."""
    from trainer.models.registry import _REGISTRY

    model_type = config.get("model_type")
    for spec in _REGISTRY.values():
        if spec.hf is not None and spec.hf.reads_config and spec.hf.model_type == model_type:
            return spec
    known = sorted(f"{s.hf.model_type} ({s.name})" for s in _REGISTRY.values() if s.hf and s.hf.reads_config)
    raise UserError(f"{key}: {folder}/config.json has model_type {model_type!r}, which no model family reads"
                    f" (known: {', '.join(known)})")


def hf_model_args(config: dict, spec: ModelSpec, flavor: str, folder: Path, key: str = _KEY) -> tuple[dict, bool]:
    """(``[model.overrides]`` that turn ``flavor`` into the model config.json describes, its tie_embeddings).
    ``tie_embeddings`` is among the overrides when it differs from the flavor's (an untied model on a tied
    flavor stays untied: ``[model] tie_embeddings`` can only turn tying on)."""
    base = spec.flavors[flavor]
    try:
        theirs = spec.hf.from_config(config, base)
    except UserError as e:
        raise UserError(f"{key}: {folder}/{e}") from None
    except (TypeError, ValueError, ZeroDivisionError, AttributeError, KeyError) as e:  # a value of the wrong kind
        raise UserError(f"{key}: {folder}/config.json is not a valid {config.get('model_type')} config"
                        f" ({type(e).__name__}: {e})") from None
    return {k: v for k, v in theirs.items() if not _same(getattr(base, k), v)}, theirs["tie_embeddings"]


def adopt_hf_config(folder: Path, spec: ModelSpec, model: Model) -> Model:
    """``[model]`` for a run that starts from the Hugging Face folder ``folder``: the model its config.json
    describes, with the user's ``[model.overrides]`` on top (each one that differs from config.json said in
    one warning). Another family than config.json's is refused, naming the right one."""
    config = read_hf_config(folder)
    theirs = hf_family(config, folder)
    if theirs.name != spec.name:
        raise UserError(f"[model] name = {spec.name!r}: {_KEY} {folder} holds a {config.get('model_type')} model, which"
                        f" is family {theirs.name!r}; set [model] name = {theirs.name!r}")
    adopted, tied = hf_model_args(config, spec, model.flavor, folder)
    mine, base = dict(model.overrides), spec.flavors[model.flavor]
    # (a key the family lacks is named by resolve_model_args afterwards)
    differ = [f"{k}={mine[k]!r} (config.json: {adopted.get(k, getattr(base, k, None))!r})"
              for k in mine if not _same(mine[k], adopted.get(k, getattr(base, k, None)))]
    if differ:
        logger.warning("[model.overrides] set other values than %s/config.json, and the configured ones are used (a"
                       " weight whose shape then differs stops the load, naming it): %s", folder, ", ".join(differ))
    taken = {k: v for k, v in adopted.items() if k not in mine and k != "tie_embeddings"}
    if taken or tied != model.tie_embeddings:
        listed = ", ".join(f"{k}={v!r}" for k, v in taken.items())
        if tied != model.tie_embeddings:
            listed += f"{', ' if listed else ''}tie_embeddings={tied} (configured: {model.tie_embeddings})"
        logger.info("[model] %s %s takes its shape from %s/config.json: %s", spec.name, model.flavor, folder, listed)
    return dataclasses.replace(model, overrides={**adopted, **mine}, tie_embeddings=tied)


def _same(a, b) -> bool:
    if (isinstance(a, (int, float)) and isinstance(b, (int, float)) and not isinstance(a, bool)
            and not isinstance(b, bool)):
        return a == b or (math.isfinite(a) and math.isfinite(b) and abs(a - b) <= 1e-9 * max(abs(a), abs(b)))
    return a == b


def _read_safetensors(path: Path, what, why: str = "", key: str = _KEY):
    """``what(f)`` of the safetensors file at ``path``; a missing or damaged file is one UserError naming it."""
    try:
        with safe_open(str(path), framework="pt") as f:
            return what(f)
    except FileNotFoundError:
        raise UserError(f"{key}: {path} is missing{why}") from None
    except Exception as e:  # safetensors raises SafetensorError (truncated header, bad offsets, ...)
        raise UserError(f"{key}: {path} is not a readable safetensors file ({type(e).__name__}: {e})") from None


def _weight_map(folder: Path, key: str = _KEY) -> dict[str, str]:
    """Tensor name -> file, from the index when there is one, else from the files' own headers."""
    index = folder / INDEX
    if index.is_file():
        weight_map = entry(read_json(index, key, what="safetensors index"), "weight_map", dict, index, key)
        for name, file in weight_map.items():
            if not isinstance(file, str) or not file or "/" in file or "\x00" in file:
                raise UserError(f"{key}: {index} weight_map[{name!r}] = {file!r}: expected the name of a safetensors"
                                " file of the folder")
        return weight_map
    weight_map = {}
    for file in sorted(folder.glob("*.safetensors")):
        weight_map.update({k: file.name for k in _read_safetensors(file, lambda f: list(f.keys()), key=key)})
    return weight_map


def _read_tensor(folder: Path, weight_map: dict[str, str], tensor: str, name: str, key: str,
                 block: tuple[int, int]) -> torch.Tensor:
    """The tensor ``tensor`` of the folder (for our ``name``); stored as float8 with block scales
    (``<tensor>_scale_inv`` per ``block``, DeepSeek-V3) or as MXFP4 (``<tensor>_blocks`` and ``<tensor>_scales``,
    gpt-oss's experts), dequantized."""
    read = lambda t: _read_safetensors(folder / weight_map[t], lambda f: f.get_tensor(t),  # noqa: E731
                                       f" (named by {INDEX} for {t!r})", key)
    if tensor in weight_map:
        part = read(tensor)
        if part.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
            scale = tensor.removesuffix("weight") + "weight_scale_inv"
            if not tensor.endswith("weight") or scale not in weight_map:
                raise UserError(f"{key}: {folder} tensor {tensor!r} is {part.dtype} without a {scale!r} to"
                                " dequantize it by; convert the folder to bfloat16 first")
            part = dequantize_fp8(part, read(scale), block, f"{key}: {folder} {scale}")
        return part
    if f"{tensor}_blocks" in weight_map and f"{tensor}_scales" in weight_map:
        blocks, scales = read(f"{tensor}_blocks"), read(f"{tensor}_scales")
        try:
            # The packed layout is nn.Linear's, (..., out, in); the HF parameter is (..., in, out).
            return dequantize_mxfp4(blocks, scales).transpose(-2, -1)
        except ValueError as e:
            raise UserError(f"{key}: {folder} {tensor}_blocks / {tensor}_scales: {e}") from None
    raise UserError(f"{key}: {folder} has no tensor {tensor!r} (for {name})")


# The 16 values of a 4-bit e2m1 float (sign, 2 exponent bits, 1 mantissa bit), by code.
FP4_E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """MXFP4 (the OCP microscaling format) -> float32: ``blocks`` (..., groups, 16) uint8 hold two e2m1 values a byte,
    the first in the low 4 bits; ``scales`` (..., groups) uint8 are each group's power of two, biased by 127.
    Returns (..., groups * 32)."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8 or blocks.shape[:-1] != scales.shape:
        raise ValueError(f"expected uint8 blocks (..., groups, 16) and uint8 scales (..., groups), got"
                         f" {blocks.dtype} {tuple(blocks.shape)} and {scales.dtype} {tuple(scales.shape)}")
    table = torch.tensor(FP4_E2M1, dtype=torch.float32)
    out = torch.empty(*blocks.shape[:-1], 32, dtype=torch.float32)
    for b, s, o in zip(blocks.reshape(-1, *blocks.shape[-2:]), scales.reshape(-1, scales.shape[-1]),
                       out.view(-1, *out.shape[-2:])):  # a row at a time: a published expert stack is 10^10 values
        o[:, 0::2], o[:, 1::2] = table[(b & 0x0F).long()], table[(b >> 4).long()]
        o.mul_(torch.exp2(s.float() - 127)[:, None])
    return out.flatten(-2)


@torch.no_grad()
def load_hf_(chunks, spec: ModelSpec, args, folder: Path, key: str = _KEY) -> None:
    """Fill the chunks' parameters from a Hugging Face safetensors folder (any layout, any split); ``key``
    names the setting or argument that named the folder in errors."""
    hf = _adapter(spec)
    weight_map = _weight_map(folder, key)
    aliases = spec.tied_aliases(args)
    block = _fp8_block(folder, key)

    for chunk in chunks:
        # the parameters, and the buffers kept in checkpoints (e.g. a router's choosing bias); a buffer the folder
        # lacks keeps its initial value (a bias that starts at zero)
        saved = set(chunk.state_dict().keys())
        buffers = [(n, b) for n, b in chunk.named_buffers() if n in saved]
        for name, param in [*chunk.named_parameters(), *buffers]:
            source = aliases.get(name, name)
            is_buffer = name in dict(buffers)
            try:
                keys = hf.names(source, args)
            except UserError:  # a buffer the family's published layout has no place for (a bias it trains itself)
                if not is_buffer:
                    raise
                keys = []
            if is_buffer and (not keys or any(t not in weight_map for t in keys)):
                logger.info("%s has no %s: %s keeps its initial value", folder, keys[0] if keys else "tensor for it",
                            name)
                continue
            parts = [_read_tensor(folder, weight_map, tensor, name, key, block) for tensor in keys]
            full = torch.stack(parts) if len(keys) > 1 else parts[0]
            shown = keys[0] if len(keys) == 1 else f"{keys[0]} ... ({len(keys)} stacked)"
            try:  # the layout (a transpose, a slice of a joined tensor) is the adapter's: compare what it gives
                ours = hf.from_hf(source, full.float(), args)
            except RuntimeError:  # a reshape that does not fit
                ours = None
            if ours is None or tuple(ours.shape) != tuple(param.shape):
                raise UserError(f"{key}: {shown} in {folder} has shape {tuple(full.shape)}, which does not give the"
                                f" model's {tuple(param.shape)}")
            copy_full_(param, ours)
    logger.info("weights loaded from Hugging Face folder %s", folder)


def _fp8_block(folder: Path, key: str) -> tuple[int, int]:
    """The block of one scale of a float8 checkpoint (config.json quantization_config.weight_block_size)."""
    path = folder / "config.json"
    quant = read_json(path, key, what="model config").get("quantization_config") if path.is_file() else None
    size = (quant or {}).get("weight_block_size", [128, 128]) if isinstance(quant, dict) else [128, 128]
    if not (isinstance(size, list) and len(size) == 2 and all(isinstance(s, int) and s > 0 for s in size)):
        raise UserError(f"{key}: {path} quantization_config.weight_block_size = {size!r}: expected two block sizes")
    return size[0], size[1]


def dequantize_fp8(weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int], where: str) -> torch.Tensor:
    """A float8 weight (rows, cols) times its per-block scales (one per ``block`` of rows x cols, the last blocks
    cut short), in float32."""
    rows, cols = weight.shape
    expected = (-(-rows // block[0]), -(-cols // block[1]))
    if tuple(scale_inv.shape) != expected:
        raise UserError(f"{where} has shape {tuple(scale_inv.shape)}: {block[0]}x{block[1]} blocks of a"
                        f" {rows}x{cols} weight take {expected}")
    scale = scale_inv.float().repeat_interleave(block[0], 0)[:rows].repeat_interleave(block[1], 1)[:, :cols]
    return weight.float() * scale
