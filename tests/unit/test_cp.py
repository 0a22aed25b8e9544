"""Context parallelism without a process group: the load-balanced split and the buffer re-indexing."""

import pytest
import torch

from tests.conftest import load_plan
from trainer.dry_run import describe_plan
from trainer.parallel.cp import apply_cp, load_balanced_positions, shard_sequence


@pytest.mark.parametrize("cp", [1, 2, 4])
def test_every_position_is_held_once_and_causal_work_is_equal(cp):
    seq = 32
    held = [load_balanced_positions(seq, cp, r) for r in range(cp)]
    assert sorted(torch.cat(held).tolist()) == list(range(seq))
    # Causal attention work of a query at position p is p + 1 keys: equal on every rank.
    work = [int((pos + 1).sum()) for pos in held]
    assert work == [seq * (seq + 1) // 2 // cp] * cp
    # rank 0 holds the first and the last chunk
    assert held[0].tolist()[: seq // (2 * cp)] == list(range(seq // (2 * cp)))
    assert held[0].tolist()[-1] == seq - 1


def test_shard_and_buffer_follow_the_same_positions():
    tokens = torch.arange(16).reshape(1, 16) * 10
    pos = load_balanced_positions(16, 2, 1)  # chunks 1 and 2 of 4: positions 4-7 and 8-11
    assert pos.tolist() == [4, 5, 6, 7, 8, 9, 10, 11]
    assert shard_sequence(tokens, pos).tolist() == [[40, 50, 60, 70, 80, 90, 100, 110]]
    model = torch.nn.Module()
    model.register_buffer("rope", torch.arange(16.0)[:, None].expand(16, 3), persistent=False)
    apply_cp(model, pos, ("rope",))
    assert model.rope[:, 0].tolist() == [float(p) for p in pos]  # row j = global position pos[j]


def test_dry_run_shows_the_context_parallel_split(tmp_path):
    plan = load_plan(["--model.attn_mask_type", "causal", "--parallelism.context_parallel_degree", "4",
                      "--parallelism.data_parallel_shard_degree", "2",
                      "--training.seq_len", "8192", "--job.dump_folder", str(tmp_path)], 8)
    text = describe_plan(plan)
    assert "dp_shard 2 * cp 4 * tp 1 * pp 1 = 8 ranks" in text
    assert "each 8192-token sequence split over 4 ranks" in text and "2048 tokens per rank" in text
    assert "FSDP shards over dp_shard x cp = 8 ranks" in text
