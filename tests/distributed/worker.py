"""Run under torchrun: train with the given overrides, recording every parameter's gradient per
step and its value at the end (tests/parity.py). Rank 0 writes the per-step losses and grad norms
to OUT.json; every rank writes its tensors to OUT.json.rank<N>.pt.

    torchrun --nproc_per_node 4 tests/distributed/worker.py OUT.json --parallelism.tensor_parallel_degree 2 ...

With ``--batch CASES.json`` (a list of {"out": OUT.json, "args": [...]}), the cases run one after
another in the same processes (tests/distributed/harness.py: Launches), each in a fresh process
group whose rendezvous keys live under a prefix of their own.
"""

import json
import logging
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402

from tests.parity import Recorder, tied_aliases  # noqa: E402
from trainer.config import load_config  # noqa: E402
from trainer.errors import UserError  # noqa: E402
from trainer.train import main  # noqa: E402


def inject_fault(name: str):
    """Deliberate defects that the parity instrument must catch (tests of the tests). Returns what undoes the
    defect, so that the cases after it in a shared launch run without it."""
    import torch.nn.functional as F

    import trainer.models.attention as attention
    import trainer.models.decoder.model as llama
    import trainer.model_parts as model_parts

    patched = []

    def patch(owner, attr: str, value) -> None:
        patched.append((owner, attr, getattr(owner, attr)))
        setattr(owner, attr, value)

    if name == "cp_rope_offset":
        real = model_parts.ModelParts.shard_inputs

        def off_by_one(self, kwargs):
            # every cp rank but the first rotates its tokens one position early (the mask stays right)
            sharded = real(self, kwargs)
            if self.techniques and int(os.environ.get("RANK", "0")) % 2 == 1:
                real_doc = llama.document_attention

                def shifted(positions, table, hidden, **kw):
                    rope, mask = real_doc(positions, table, hidden, **kw)
                    return (real_doc((positions - 1).clamp(min=0), table, hidden, **kw)[0] if positions is not None
                            else rope), mask

                patch(llama, "document_attention", shifted)
            return sharded

        patch(model_parts.ModelParts, "shard_inputs", off_by_one)
    elif name == "cp_mask_ignores_documents":  # the gathered attention masks by position only
        real = attention.block_causal_mask

        def by_position(positions, dtype, window=None):
            # under a layout, positions past any query's index: each query's "document" starts before the window
            far = torch.full_like(positions, 1 << 30)
            return real(far if attention._LAYOUTS else positions, dtype, window)

        patch(attention, "block_causal_mask", by_position)
        patch(llama, "block_causal_mask", by_position)
    elif name == "cp_positions_do_not_restart":  # each rank's tokens rotated by their index in the whole window
        real = model_parts.ModelParts.shard_inputs

        def global_index(self, kwargs):
            whole = [{k: torch.arange(v.shape[1]).expand(v.shape).to(v.device) for k, v in inputs.items()}
                     for inputs in kwargs]
            return real(self, whole)

        patch(model_parts.ModelParts, "shard_inputs", global_index)
    elif name == "tracer_drops_positions":  # traced blocks attend causally across documents (positions lost)
        real = llama.document_attention

        def whole_window(positions, table, hidden, **kw):
            if positions is not None and torch.compiler.is_exporting():
                positions = torch.arange(positions.shape[1]).expand(positions.shape)
            return real(positions, table, hidden, **kw)

        patch(llama, "document_attention", whole_window)
    elif name == "attention_without_sdpa":
        import types

        def by_hand(q, k, v, is_causal=False, enable_gqa=False, **_):  # softmax(q k^T / sqrt(d)) v, causal
            if enable_gqa:
                k, v = (t.repeat_interleave(q.shape[1] // t.shape[1], dim=1) for t in (k, v))
            scores = q @ k.transpose(-2, -1) / q.shape[-1] ** 0.5
            mask = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool, device=q.device).tril()
            return scores.masked_fill(~mask, float("-inf")).softmax(-1) @ v

        patch(llama, "F", types.SimpleNamespace(**{**vars(F), "scaled_dot_product_attention": by_hand}))
    elif name == "other_data_on_rank1":  # as if rank 1's node held other files at the same path
        if os.environ.get("RANK") == "1":
            import trainer.data.loader as loader

            patch(loader.WindowLoader, "fingerprint", property(lambda self: "shards=something-else"))
    elif name == "other_config_on_rank1":  # as if rank 1's node held another config file
        if os.environ.get("RANK") == "1":
            real = load_config
            patch(sys.modules[__name__], "load_config",
                  lambda overrides: real(overrides=[*overrides, "--training.steps", "5"]))
    elif name in ("other_planner_on_rank1", "smaller_device_on_rank1"):
        # as if rank 1 ran another planner (or, the second, searched within a smaller device's memory): it keeps the
        # second-best split
        if os.environ.get("RANK") == "1":
            import dataclasses

            import trainer.pipeline.split as split

            if name == "smaller_device_on_rank1":
                import trainer.pipeline.cost as cost
                import trainer.plan

                real_memory = cost.device_memory_bytes
                patch(trainer.plan, "device_memory_bytes", lambda: real_memory() // 2)
                patch(cost, "device_memory_bytes", lambda: real_memory() // 2)
            real = split.search_splits

            def second_best(*args, **kwargs):
                search = real(*args, **kwargs)
                return dataclasses.replace(search, best=search.best[1:] + search.best[:1])

            patch(split, "search_splits", second_best)
    elif name:
        raise ValueError(f"unknown PARITY_FAULT {name!r}")

    def undo() -> None:
        for owner, attr, value in reversed(patched):
            setattr(owner, attr, value)

    return undo


def run_case(out: str, overrides: list[str]) -> None:
    config = load_config(overrides=overrides)
    recorder = Recorder(tied_aliases(config))
    result = main(config, observer=recorder)
    rank = int(os.environ.get("RANK", "0"))
    # Written whole or not at all (renamed into place): a shared launch that dies leaves no torn file.
    torch.save(recorder.tensors, f"{out}.rank{rank}.pt.part")
    os.replace(f"{out}.rank{rank}.pt.part", f"{out}.rank{rank}.pt")
    if rank == 0:
        Path(f"{out}.part").write_text(json.dumps({"losses": result.losses, "grad_norms": result.grad_norms,
                                                   "eval_losses": result.eval_losses,
                                                   "activation_peaks": result.activation_peaks}))
        os.replace(f"{out}.part", out)


def forget_meshes() -> None:
    """Drop DTensor's caches of sharding decisions and redistributions after a case of a shared launch.

    Their entries hold the case's DeviceMesh, and meshes compare equal without their process groups,
    whose names restart after ``destroy_process_group``: a later case with an equal mesh could reuse
    an entry that names another case's group."""
    if "torch.distributed.tensor" not in sys.modules:
        return
    from torch.distributed.tensor import DTensor, _redistribute

    clear_cpp = getattr(torch._C, "_clear_DTensor_sharding_propagator_cache", None)
    if clear_cpp is not None:
        clear_cpp()
    for cached in (DTensor._op_dispatcher.sharding_propagator.propagate_op_sharding,
                   getattr(_redistribute, "_gen_transform_infos", None)):
        if hasattr(cached, "cache_clear"):
            cached.cache_clear()


def in_namespace(prefix: str) -> None:
    """Make the next process groups keep their rendezvous keys under ``prefix`` in torchrun's store.

    A process group created again after ``destroy_process_group`` would otherwise read the keys its
    predecessor left there (gloo's peer addresses, barrier counts) and wait on dead connections."""
    import torch.distributed as dist

    real = getattr(dist.init_process_group, "real", dist.init_process_group)

    def init_process_group(*args, **kwargs):
        extra = {"timeout": kwargs["timeout"]} if kwargs.get("timeout") is not None else {}
        store, rank, world_size = next(dist.rendezvous("env://", **extra))
        return real(*args, store=dist.PrefixStore(prefix, store), rank=rank, world_size=world_size, **kwargs)

    init_process_group.real = real
    dist.init_process_group = init_process_group


if __name__ == "__main__":
    inject_fault(os.environ.get("PARITY_FAULT", ""))
    try:
        if sys.argv[1] == "--batch":
            for i, case in enumerate(json.loads(Path(sys.argv[2]).read_text())):
                in_namespace(f"case{i}")
                undo = inject_fault(case.get("fault", ""))
                run_case(case["out"], case["args"])
                undo()
                forget_meshes()
        else:
            run_case(sys.argv[1], sys.argv[2:])
    except UserError as e:  # as train.py reports it
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    # Every result is on disk: end without the interpreter's teardown of torch's modules, ~1 s per rank (4 ranks
    # on 2 cores: ~2.5 s per launch).
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
