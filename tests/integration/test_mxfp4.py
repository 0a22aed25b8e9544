"""MXFP4 experts, as gpt-oss checkpoints are published (``<name>_blocks``: two e2m1 codes a byte, the first in the low
4 bits; ``<name>_scales``: one power of two per 32 values, biased by 127), are dequantized when a folder is read."""

import torch
from safetensors.torch import load_file, save_file

from tests.integration.test_families import PROMPT, VOCAB, hf_model, logits_of
from trainer import convert
from trainer.convert import load_checkpoint
from trainer.data.tokenizer import HFTokenizer, Tokenizer
from trainer.hf import dequantize_mxfp4

# e2m1 by code: sign bit 3, exponent bits 2-1 (bias 1; 0 = subnormal, 0.5 per mantissa step), mantissa bit 0
E2M1 = [(-1) ** (c >> 3) * ((c >> 1 & 3) and 2 ** ((c >> 1 & 3) - 1) * (1 + (c & 1) / 2) or (c & 1) / 2)
        for c in range(16)]


def pack(codes: torch.Tensor) -> torch.Tensor:
    """(..., groups * 32) codes 0-15 -> (..., groups, 16) bytes, the even-indexed code in the low 4 bits."""
    codes = codes.reshape(*codes.shape[:-1], -1, 32).to(torch.uint8)
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def random_mxfp4(*shape: int, generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(blocks, scales, the values they hold) for a (..., rows, columns) tensor."""
    codes = torch.randint(0, 16, shape, generator=generator)
    scales = torch.randint(122, 126, (*shape[:-1], shape[-1] // 32), generator=generator, dtype=torch.uint8)
    values = torch.tensor(E2M1)[codes] * 2.0 ** (scales.float() - 127).repeat_interleave(32, dim=-1)
    return pack(codes), scales, values


def test_known_values_dequantize_as_packed():
    assert E2M1[:8] == [0, 0.5, 1, 1.5, 2, 3, 4, 6] and E2M1[9:] == [-v for v in E2M1[1:8]]
    codes = torch.arange(64) % 16  # every code, low and high nibbles
    scales = torch.tensor([[127, 130]], dtype=torch.uint8)  # x 1 and x 8
    out = dequantize_mxfp4(pack(codes[None]), scales)
    expected = torch.tensor(E2M1 * 4) * torch.tensor([1.0] * 32 + [8.0] * 32)
    assert torch.equal(out, expected[None])
    blocks, scales, values = random_mxfp4(3, 8, 64, generator=torch.Generator().manual_seed(0))
    assert torch.equal(dequantize_mxfp4(blocks, scales), values)


def test_a_gpt_oss_folder_with_mxfp4_experts_imports(tmp_path):
    """A tiny gpt-oss with experts of exactly representable values, written as MXFP4 in place of its expert weights:
    the import computes transformers' logits with those weights."""
    source = hf_model("gpt_oss")
    g = torch.Generator().manual_seed(1)
    packed = {}
    with torch.no_grad():
        for name, p in source.named_parameters():
            if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
                # the packed layout is (experts, out, in); transformers' parameter (experts, in, out)
                blocks, scales, values = random_mxfp4(p.shape[0], p.shape[2], p.shape[1], generator=g)
                p.copy_(values.transpose(1, 2))
                packed[f"{name}_blocks"], packed[f"{name}_scales"] = blocks, scales
    source.save_pretrained(str(tmp_path / "hf"))
    Tokenizer(max_ranks=VOCAB - 2).save_hf(tmp_path / "hf")
    file = tmp_path / "hf" / "model.safetensors"
    tensors = {k: v for k, v in load_file(str(file)).items() if not k.endswith(("gate_up_proj", "down_proj"))}
    save_file({**tensors, **packed}, str(file), metadata={"format": "pt"})

    assert convert.run(["from-hf", str(tmp_path / "hf"), str(tmp_path / "seed")]) == 0
    seed = load_checkpoint(tmp_path / "seed" / "checkpoint",
                           ["--job.config_file", str(tmp_path / "seed" / "model.toml")], key="test", seq_len=64)
    ids = HFTokenizer(tmp_path / "seed" / "tokenizer.json").encode(PROMPT, bos=True)
    torch.testing.assert_close(logits_of(seed.model, ids), logits_of(source, ids), rtol=1e-5, atol=1e-5)
