"""ParallelDims arithmetic and its errors; mesh names and sizes at world size 8 (fake process group)."""

import pytest
import torch
import torch.distributed as dist

from trainer.config import load_config
from trainer.errors import ConfigError
from trainer.parallel.dims import ParallelDims
from trainer.parallel.mesh import build_meshes


def dims(world: int, **degrees) -> ParallelDims:
    names = {
        "rep": "data_parallel_replicate_degree", "shard": "data_parallel_shard_degree",
        "tp": "tensor_parallel_degree", "pp": "pipeline_parallel_degree", "cp": "context_parallel_degree",
    }
    args = []
    for short, value in degrees.items():
        args += [f"--parallelism.{names[short]}", str(value)]
    parallelism = load_config(overrides=args).parallelism if "cp" not in degrees else _raw(args)
    return ParallelDims.from_config(parallelism, world)


def _raw(args):
    from trainer.config.loader import _build, parse_cli
    from trainer.config.schema import JobConfig

    flat, *_ = parse_cli(args)
    return _build(JobConfig, flat, ()).parallelism


def test_only_plain_replicas_use_the_ddp_reducer():
    """torch's DDP reducer (trainer/parallel/ddp.py) takes replicas of a whole model; any other degree keeps FSDP2."""
    assert dims(2, rep=2, shard=1).plain_ddp
    assert dims(4, rep=4, shard=1).plain_ddp
    for other in (dims(4, rep=2, shard=2), dims(4, rep=2, shard=1, tp=2), dims(4, rep=2, shard=1, pp=2),
                  dims(4, rep=2, shard=1, cp=2), dims(2, shard=2), dims(1)):
        assert not other.plain_ddp, other.describe()
    assert "DDP reducer" in dims(2, rep=2, shard=1).data_parallel()
    assert "FSDP2 on a (replicate 2, shard 1)" in dims(4, rep=2, shard=1, tp=2).data_parallel()
    assert dims(1).data_parallel() == ""


def test_shard_degree_takes_the_rest():
    d = dims(8, tp=2)
    assert (d.dp_replicate, d.dp_shard, d.tp, d.dp) == (1, 4, 2, 4)
    assert d.grad_average == 4
    assert dims(8, rep=2, shard=2, tp=2).grad_average == 4
    assert dims(8, shard=2, cp=2, tp=2).grad_average == 4  # cp ranks' gradients are averaged too
    assert dims(8, pp=2, tp=2).dp_shard == 2


@pytest.mark.parametrize(
    "world, degrees, message",
    [
        (8, dict(rep=2, shard=2, tp=4), "dp_replicate 2 * dp_shard 2 * cp 1 * tp 4 * pp 1 = 16 != WORLD_SIZE 8"),
        (8, dict(shard=2), "dp_replicate 1 * dp_shard 2 * cp 1 * tp 1 * pp 1 = 2 != WORLD_SIZE 8"),
        (6, dict(tp=4), "dp_replicate 1 * cp 1 * tp 4 * pp 1 = 4 does not divide WORLD_SIZE 6"),
        (8, dict(pp=3), "tp 1 * pp 3 = 3 does not divide WORLD_SIZE 8"),
        (2, dict(rep=2, shard=2), "= 4 != WORLD_SIZE 2"),
    ],
)
def test_degree_errors_show_the_arithmetic(world, degrees, message):
    with pytest.raises(ConfigError) as info:
        dims(world, **degrees)
    assert message in str(info.value) and str(info.value).startswith("[parallelism]")


def test_single_process_has_no_meshes():
    meshes = build_meshes(dims(1), "cpu")
    assert meshes.world is None and meshes.tp is None and meshes.fsdp is None and meshes.dp_rank == 0
    assert meshes.batch_groups() == []


@pytest.fixture
def fake_world():
    from torch.testing._internal.distributed.fake_pg import FakeStore

    def start(rank: int, world: int):
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)

    yield start
    dist.destroy_process_group()


def test_mesh_names_and_sizes_at_world_8(fake_world):
    fake_world(rank=5, world=8)
    meshes = build_meshes(dims(8, rep=2, shard=2, tp=2), "cpu")
    assert meshes.world.mesh_dim_names == ("pp", "dp_replicate", "dp_shard", "cp", "tp")
    assert tuple(meshes.world.shape) == (1, 2, 2, 1, 2)
    assert meshes.tp.mesh_dim_names == ("tp",) and meshes.tp.size() == 2
    assert meshes.fsdp.mesh_dim_names == ("dp_replicate", "dp_shard") and tuple(meshes.fsdp.shape) == (2, 2)
    assert meshes.pp is None
    # tp innermost: rank 5 = (rep 1, shard 0, tp 1); its TP peer is rank 4, its batch index 2.
    assert meshes.tp.mesh.tolist() == [4, 5]
    assert meshes.dp_rank == 2 and len(meshes.batch_groups()) == 2


def test_fsdp_mesh_per_layout(fake_world):
    fake_world(rank=0, world=8)
    assert build_meshes(dims(8, shard=8), "cpu").fsdp.mesh_dim_names == ("dp_shard",)
    ddp = build_meshes(dims(8, rep=4, shard=1, tp=2), "cpu")
    assert ddp.fsdp.mesh_dim_names == ("dp_replicate", "dp_shard") and tuple(ddp.fsdp.shape) == (4, 1)
    assert build_meshes(dims(8, shard=1, tp=8), "cpu").fsdp is None


def test_plain_ddp_gets_the_reducer_group_and_no_fsdp_mesh(fake_world):
    fake_world(rank=3, world=8)
    meshes = build_meshes(dims(8, rep=8, shard=1), "cpu")
    assert meshes.fsdp is None and meshes.ddp.size() == 8
    assert build_meshes(dims(8, rep=4, shard=1, tp=2), "cpu").ddp is None


def test_bfloat16_reduction_hook_sends_the_mean_in_bfloat16(fake_world):
    """DDP's bucket hook for mixed_precision_reduce = bfloat16: divided by the group size, rounded to bfloat16 for the
    all-reduce (the fake group's all-reduce returns its input), written back into the float32 bucket."""
    from trainer.parallel.ddp import _bfloat16_all_reduce

    fake_world(rank=0, world=2)
    buffer = torch.tensor([1.0 + 2**-12, 3.0, -0.1])

    class Bucket:
        def buffer(self):
            return buffer

    out = _bfloat16_all_reduce(dist.group.WORLD, Bucket()).wait()
    expected = (torch.tensor([1.0 + 2**-12, 3.0, -0.1]) / 2).to(torch.bfloat16).float()
    assert out is buffer and torch.equal(buffer, expected) and buffer[0].item() == 0.5  # 2**-13 lost to bfloat16


def test_context_parallel_ranks_join_the_shard_dimension(fake_world):
    fake_world(rank=5, world=8)
    meshes = build_meshes(dims(8, shard=2, cp=2, tp=2), "cpu")
    # rank 5 = 4 * shard 1 + 2 * cp 0 + tp 1: its cp peer is rank 7; FSDP shards over dp_shard x cp = 4 ranks
    assert meshes.cp.mesh.tolist() == [5, 7]
    assert meshes.fsdp.mesh_dim_names == ("dp_shard_cp",) and meshes.fsdp.size() == 4
    assert meshes.dp_rank == 1 and len(meshes.batch_groups()) == 2
    hsdp = build_meshes(dims(8, rep=2, shard=2, cp=2), "cpu")
    assert hsdp.fsdp.mesh_dim_names == ("dp_replicate", "dp_shard_cp") and tuple(hsdp.fsdp.shape) == (2, 4)
