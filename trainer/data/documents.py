"""Documents within packed windows, for block-causal attention (``[model] attn_mask_type``).

Every loader packs documents as ``[BOS] text EOS`` (``text EOS`` for tokenizers without BOS) end
to end, so the boundaries are in the tokens themselves: a document begins after each end-of-text
token. Deriving them from the window keeps every loader (token shards, mixing, streaming)
deterministic and resumable exactly as before, and a window that starts mid-document simply
begins with that document's remainder (document 0, positions from 0). A model that attends within
documents receives each token's position within its document (``positions``), from which it rotates
its tokens and builds its mask (trainer.models.attention.block_causal_mask).
"""

from collections.abc import Callable

import torch


def document_ids(tokens: torch.Tensor, eos_id: int, bos_id: int | None = None) -> torch.Tensor:
    """(batch, seq) tokens -> (batch, seq) int32: the index of each token's document within its window
    (0 up to the first end-of-text token, which still belongs to it; 1 after it; ...). A tokenizer whose
    begin- and end-of-text are one token (GPT-2's ``<|endoftext|>``) wraps documents as ``E text E``: there an
    E that text follows begins a document (it is not one of its own), and only an E followed by E (or by the
    window's end) ends one."""
    ends = tokens == eos_id
    if bos_id == eos_id:
        followed_by_end = torch.ones_like(ends)
        followed_by_end[:, :-1] = tokens[:, 1:] == eos_id
        ends &= followed_by_end
    ends = ends.to(torch.int32)
    return ends.cumsum(1, dtype=torch.int32) - ends


def positions_in_documents(documents: torch.Tensor) -> torch.Tensor:
    """(batch, seq) document indices within each window (``document_ids``) -> each token's position within its
    document, int64 (0 where a document starts)."""
    index = torch.arange(documents.shape[1])
    starts = torch.ones_like(documents, dtype=torch.bool)
    starts[:, 1:] = documents[:, 1:] != documents[:, :-1]
    first = torch.cummax(torch.where(starts, index, 0), dim=1).values  # where each token's document begins
    return index - first


def model_inputs(attn_mask_type: str, eos_id: int, bos_id: int | None = None, *,
                 always: bool = False) -> Callable[[torch.Tensor], dict]:
    """A batch's tokens, on the host -> the model's keyword inputs: under block-causal attention each token's
    ``positions`` within its document, unless no window of the batch crosses a document boundary (then nothing:
    the model runs the plain causal kernel, which computes the same). Deciding on the loader's CPU tensors,
    before they are copied to the device, means the model never waits for the device to find out (``on_device``).
    ``always``: positions for every batch, whole windows' positions (0, 1, ...) under causal attention (context
    parallelism, whose ranks hold parts of each sequence, and traced pipeline stages, whose graph has the input)."""
    if attn_mask_type != "block_causal":
        if not always:
            return lambda tokens: {}
        return lambda tokens: {"positions": torch.arange(tokens.shape[1]).expand(tokens.shape)}

    def inputs(tokens: torch.Tensor) -> dict:
        ids = document_ids(tokens, eos_id, bos_id)
        return {"positions": positions_in_documents(ids)} if always or bool(ids.any()) else {}

    return inputs


Microbatches = list[tuple[torch.Tensor, torch.Tensor]]


def on_device(microbatches: Microbatches, device: torch.device,
              model_kwargs: Callable[[torch.Tensor], dict]) -> tuple[Microbatches, list[dict]]:
    """A step's host microbatches (inputs, labels) moved to ``device``, and each one's model keyword inputs
    (``model_kwargs`` of its host inputs, moved alike)."""
    kwargs = [{k: v.to(device) for k, v in model_kwargs(x).items()} for x, _ in microbatches]
    return [(x.to(device), y.to(device)) for x, y in microbatches], kwargs
