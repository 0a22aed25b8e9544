"""The makespan planner: exact against brute force, rank-balanced V splits, memory limits, the dry run's
prediction, calibration from measured action times and the cost file."""

import itertools
import json
import random
import re
from dataclasses import replace

import pytest

from tests.conftest import load_plan
from trainer.dry_run import describe_plan
from trainer.errors import ConfigError
from trainer.pipeline.calibrate import fit_costs
from trainer.pipeline.cost import PartCosts, SplitMemory, calibrated_costs, flop_costs
from trainer.pipeline import search as planner
from trainer.pipeline.search import Simulator, search_splits
from trainer.pipeline.simulate import KINDS, program_for
from trainer.plan import JobPlan

PP2_ZBV = ["--parallelism.pipeline_parallel_degree", "2", "--parallelism.pipeline_parallel_schedule", "ZBVZeroBubble"]


def random_costs(rng: random.Random, n_blocks: int, send: float = 0.0) -> PartCosts:
    """Blocks of unequal cost, an embedding and a heavy output: F, and I / W of different weights."""
    fwd = [rng.uniform(0.0, 0.3)] + [rng.uniform(0.5, 2.0) for _ in range(n_blocks)] + [rng.uniform(0.2, 3.0)]
    inp = [f * rng.uniform(0.8, 1.6) for f in fwd]
    wgt = [f * rng.uniform(0.6, 1.2) for f in fwd]
    parts = {"F": tuple(fwd), "I": tuple(inp), "W": tuple(wgt), "B": tuple(i + w for i, w in zip(inp, wgt))}
    return PartCosts(parts, {k: rng.uniform(0.0, 0.1) for k in KINDS}, send, "units", "random")


def brute_force(sim: Simulator) -> list[float]:
    """Every contiguous split's makespan, smallest first (written apart from the planner's search)."""
    n, stages = sim.costs.num_blocks, sim.program.num_stages
    out = []
    for cuts in itertools.combinations(range(1, n), stages - 1):
        bounds = (0, *cuts, n)
        out.append(sim.predict(tuple(b - a for a, b in zip(bounds, bounds[1:]))).makespan)
    return sorted(out)


CASES = [  # schedule, pp, stages per rank, microbatches
    ("1F1B", 2, 1, 4), ("1F1B", 4, 1, 8), ("GPipe", 3, 1, 4),
    ("Interleaved1F1B", 2, 2, 4), ("Interleaved1F1B", 2, 3, 4), ("Interleaved1F1B", 2, 4, 4),
    ("InterleavedZeroBubble", 2, 2, 4), ("LoopedBFS", 3, 2, 3),
    ("ZBVZeroBubble", 2, 2, 4), ("ZBVZeroBubble", 3, 2, 6), ("ZBVZeroBubble", 4, 2, 8), ("DualPipeV", 2, 2, 4),
]


@pytest.mark.parametrize("schedule,pp,per_rank,m", CASES)
def test_the_planner_finds_the_exhaustive_optimum(schedule, pp, per_rank, m):
    """Random part costs (and a transfer time): both the full enumeration and the branch and bound return
    the four best makespans of a brute-force search."""
    rng = random.Random(f"{schedule}-{pp}-{per_rank}")
    program = program_for(schedule, pp, m, per_rank)
    for trial in range(3):
        n_blocks = pp * per_rank + rng.randint(2, 5)
        sim = Simulator(random_costs(rng, n_blocks, send=rng.choice([0.0, 0.3])), program)
        every = brute_force(sim)
        exact = search_splits(sim)
        assert exact.exact and exact.best[0].makespan == pytest.approx(every[0], rel=1e-12)
        assert [p.makespan for p in exact.best] == pytest.approx(every[:4], rel=1e-12)
        pruned = search_splits(sim, enumerate_up_to=0)  # branch and bound, with a budget it does not reach
        assert pruned.exact and pruned.evaluated <= len(every)
        assert [p.makespan for p in pruned.best] == pytest.approx(every[:4], rel=1e-12)


def test_the_search_under_a_small_budget_stops_there_with_a_split_no_worse_than_the_even_one():
    """32 blocks on 8 V stages (2.6M splits): the search stops at its budget and returns a split at least as
    good as the even one."""
    rng = random.Random(7)
    sim = Simulator(random_costs(rng, 32), program_for("ZBVZeroBubble", 4, 8, 2))
    found = search_splits(sim, budget=300)
    assert not found.exact and found.evaluated <= 300
    assert found.best[0].makespan <= sim.predict((4,) * 8).makespan
    assert 0 < found.visited <= planner.NODES_PER_REPLAY * 300


def test_the_branch_and_bound_prices_a_stage_as_its_table_does():
    """The running sums the branch and bound prices partial splits with give every stage's load as the full
    table does: the embedding on stage 0 (whose whole backward is its W), the output on the last, the fixed cost
    per action, for every range of blocks a stage can hold."""
    rng = random.Random(3)
    for schedule, pp, per_rank, m in (("ZBVZeroBubble", 2, 2, 4), ("1F1B", 3, 1, 6), ("Interleaved1F1B", 2, 2, 4)):
        sim = Simulator(random_costs(rng, 7), program_for(schedule, pp, m, per_rank))
        n, stages = 7, sim.program.num_stages
        for s in range(stages):
            for start in range(s, n):
                for end in range(start + 1, n - (stages - 1 - s) + 1):
                    if s == stages - 1 and end != n:
                        continue
                    counts = [1] * s + [end - start] + [1] * (stages - 1 - s)
                    counts[0] += start - s  # the stages before hold blocks 0 .. start - 1
                    if s < stages - 1:
                        counts[-1] += n - end - (stages - 1 - s)
                    if min(counts) < 1 or s == 0 and start:
                        continue
                    assert sum(counts) == n
                    table = sim.costs.stage_table(counts)
                    assert sim.load_of(s, start, end) == pytest.approx(sim.stage_load(table, s), rel=1e-12)


@pytest.mark.parametrize("schedule,pp,per_rank,m", CASES)
def test_the_bound_without_a_replay_holds_for_every_split(schedule, pp, per_rank, m):
    """Simulator.bound (a rank's busy time after one microbatch's forward reaches its first stage) is never above a
    split's replayed step, with and without transfers; and the forward term is not idle beyond two ranks: it is
    above the busiest rank's time for some split."""
    rng = random.Random(f"{schedule}-{pp}-{per_rank}-bound")
    program = program_for(schedule, pp, m, per_rank)
    above_busiest = {}
    for send in (0.0, 0.3):  # without transfers the forward alone makes the reach
        sim = Simulator(random_costs(rng, pp * per_rank + 3, send=send), program)
        above_busiest[send] = 0
        for cuts in itertools.combinations(range(1, sim.costs.num_blocks), program.num_stages - 1):
            counts = tuple(b - a for a, b in zip((0, *cuts), (*cuts, sim.costs.num_blocks)))
            pred, bound = sim.predict(counts), sim.bound(counts)
            assert bound <= pred.makespan * (1 + 1e-9), (counts, bound, pred.makespan)
            table = sim.costs.stage_table(counts)
            priced = max(sum(sim.stage_load(table, s) for s in ids) for ids in sim.stage_ids)
            above_busiest[send] += bound > priced * (1 + 1e-9)
    if pp > 2:
        assert above_busiest[0.0] > 0 and above_busiest[0.3] > 0, above_busiest


def test_the_descent_skips_only_splits_that_cannot_be_kept(monkeypatch):
    """Moves whose bound is above both the four kept splits and the descent's current split are not replayed: each
    descent from a seed stops where it stops without the bound, the same four splits are kept, in fewer replays
    (the branch and bound left out, so nothing else finds them). Seeded first with the best split there is, the
    later descents start above the kept splits: a move that beats their current split must still be replayed."""
    monkeypatch.setattr(planner, "_branch_and_bound", lambda *args: False)
    sim = Simulator(random_costs(random.Random(11), 14, send=0.2), program_for("ZBVZeroBubble", 3, 6, 2))
    n, stages = sim.costs.num_blocks, sim.program.num_stages
    best = min((tuple(b - a for a, b in zip((0, *cuts), (*cuts, n))) for cuts in
                itertools.combinations(range(1, n), stages - 1)), key=lambda c: sim.predict(c).makespan)
    descend, ends = planner._descend, []
    monkeypatch.setattr(planner, "_descend", lambda *args: ends.append(descend(*args)) or ends[-1])
    pruned = search_splits(sim, seed=best, enumerate_up_to=0)
    pruned_ends, ends[:] = [p.counts for p in ends], []
    monkeypatch.setattr(Simulator, "bound", lambda self, counts: 0.0)
    replayed = search_splits(sim, seed=best, enumerate_up_to=0)
    assert pruned_ends == [p.counts for p in ends] and len(pruned_ends) == 3
    assert pruned_ends[1] != planner._rank_balanced(sim)  # the second descent moved from its seed
    assert [(p.counts, p.makespan) for p in pruned.best] == [(p.counts, p.makespan) for p in replayed.best]
    assert pruned.evaluated < replayed.evaluated
    # Unseeded: the kept splits come from moves the descents passed by (not stepped to), on other shapes too
    for trial, (schedule, pp, per_rank, m) in enumerate([("ZBVZeroBubble", 2, 2, 4), ("Interleaved1F1B", 3, 2, 6),
                                                         ("1F1B", 4, 1, 8), ("DualPipeV", 3, 2, 6)]):
        sim = Simulator(random_costs(random.Random(f"skip-{trial}"), 16, send=0.1),
                        program_for(schedule, pp, m, per_rank))
        monkeypatch.undo()
        monkeypatch.setattr(planner, "_branch_and_bound", lambda *args: False)
        pruned = search_splits(sim, enumerate_up_to=0)
        monkeypatch.setattr(Simulator, "bound", lambda self, counts: 0.0)
        replayed = search_splits(sim, enumerate_up_to=0)
        assert [(p.counts, p.makespan) for p in pruned.best] == [(p.counts, p.makespan) for p in replayed.best]
    # Many microbatches, where the bound is near the step: seeded with the best split, the moves from it are above it
    # by their bound, yet they are the next best until four are kept (a skip against the descent's split alone
    # drops them)
    for schedule, pp, per_rank, name in [("1F1B", 3, 1, "tight-1F1B-1"), ("Interleaved1F1B", 2, 2, "tight-I-0")]:
        sim = Simulator(random_costs(random.Random(name), 9), program_for(schedule, pp, 16, per_rank))
        n, stages = sim.costs.num_blocks, sim.program.num_stages
        best = min((tuple(b - a for a, b in zip((0, *cuts), (*cuts, n))) for cuts in
                    itertools.combinations(range(1, n), stages - 1)), key=lambda c: sim.predict(c).makespan)
        monkeypatch.undo()
        monkeypatch.setattr(planner, "_branch_and_bound", lambda *args: False)
        pruned = search_splits(sim, seed=best, enumerate_up_to=0)
        assert sum(sim.bound(p.counts) > pruned.best[0].makespan for p in pruned.best[1:]) >= 2
        monkeypatch.setattr(Simulator, "bound", lambda self, counts: 0.0)
        replayed = search_splits(sim, seed=best, enumerate_up_to=0)
        assert [(p.counts, p.makespan) for p in pruned.best] == [(p.counts, p.makespan) for p in replayed.best]


def test_the_branch_and_bound_stops_at_its_node_budget_with_a_real_split(monkeypatch):
    """Partial splits visited count against the budget too (each is cheap, but there can be millions): with
    one node per replay the search stops early, and its split is still a real one against brute force."""
    monkeypatch.setattr(planner, "NODES_PER_REPLAY", 1)
    rng = random.Random(5)
    sim = Simulator(random_costs(rng, 20), program_for("ZBVZeroBubble", 2, 4, 2))
    every = brute_force(sim)
    found = search_splits(sim, budget=60, enumerate_up_to=0)
    assert not found.exact and found.visited == 60 and found.evaluated < 60  # the nodes ran out, not the replays
    # By default the cap is on the branch and bound's own budget, not on it plus the descents' replays
    monkeypatch.setattr(planner, "REPLAY_BUDGET", 64 * len(sim.program.actions))  # the least budget, 64 splits
    default = search_splits(sim)
    assert not default.exact and default.visited == 64  # with the descents' replays added it visits more
    assert every[0] <= found.best[0].makespan
    assert any(m == pytest.approx(found.best[0].makespan, rel=1e-12) for m in every)  # a real split's step


def test_the_search_moves_a_block_between_a_ranks_two_v_stages():
    """8B on 4 x 2 V stages (2.6M splits, beyond the budget): from the split that moving one cut at a time
    settles on, (5,3,4,4,4,4,5,3), the better (5,4,4,4,4,4,4,3) is one block from stage 6 to stage 1, both on
    pp rank 1; one cut at a time would pass through slower splits. The search finds a split at least as fast
    within its default budget (a 30x longer search of the earlier kind found none faster)."""
    plan = load_plan(["--job.config_file", "configs/llama3_8b.toml", "--parallelism.pipeline_parallel_degree", "4",
                      "--parallelism.pipeline_parallel_schedule", "ZBVZeroBubble", "--training.local_batch_size", "8",
                      "--activation_checkpoint.mode", "full", "--compile.no-enable"], 4, check_memory=False)
    sim = Simulator(plan.pipeline_costs, program_for("ZBVZeroBubble", 4, plan.n_microbatches, 2))
    assert sim.stage_ids[1] == [1, 6]
    settled, traded = sim.predict((5, 3, 4, 4, 4, 4, 5, 3)), sim.predict((5, 4, 4, 4, 4, 4, 4, 3))
    assert traded.makespan < settled.makespan
    found = search_splits(sim)
    assert not found.exact and found.best[0].makespan <= traded.makespan * (1 + 1e-12)


def test_v_placement_balances_ranks_not_stages():
    """The issue's case: debug model, PP2 ZBVZeroBubble. The stage-balanced split (layers.1, .3, .5) gives
    rank 0 two blocks + output and rank 1 four blocks; the planner's split evens the ranks' work and its
    simulated step is shorter."""
    plan = load_plan(PP2_ZBV)
    old = load_plan(PP2_ZBV + ["--parallelism.pipeline_parallel_split_mode", "flops"])
    assert old.pipeline.split_points() == ["layers.1", "layers.3", "layers.5"]
    p = plan.pipeline
    sim = Simulator(plan.pipeline_costs, program_for(p.schedule, p.pp, plan.n_microbatches, p.stages_per_rank))
    new, before = sim.predict(p.counts), sim.predict(old.pipeline.counts)
    assert new.makespan < before.makespan
    assert max(new.busy) / min(new.busy) < max(before.busy) / min(before.busy)
    # Both ranks hold three blocks, rank 0 also the embedding and output
    assert sum(p.counts[s] for s in (0, 3)) == 3 and sum(p.counts[s] for s in (1, 2)) == 3


@pytest.mark.parametrize("schedule", ["ZBVZeroBubble", "1F1B"])
def test_the_planners_memory_check_is_the_dry_runs_memory_table(tmp_path, schedule):
    """What a split is checked against the limit with is each rank's total in the dry run's memory table: state,
    activations and, on the rank of the last stage (rank 0 under V placement, the last rank under loop), the loss's
    gradient; a large vocabulary makes that last term count."""
    plan = load_plan(["--parallelism.pipeline_parallel_degree", "2", "--parallelism.pipeline_parallel_schedule",
                      schedule, "--model.overrides.vocab_size", "100000", "--job.dump_folder", str(tmp_path)],
                     check_memory=False)
    rank_bytes = SplitMemory(plan.config, plan.spec, plan.model_args, plan.build_model(), plan.dims, "cuda",
                             plan.n_microbatches).rank_bytes
    table = describe_plan(plan).split("total GiB\n")[1].splitlines()[1:3]
    totals = [line.split()[-1] for line in table]
    loss = [line.split()[-2] for line in table]
    assert max(map(float, loss)) > 0.1
    placement = [plan.pipeline.stage_ids(r) for r in range(2)]
    assert [f"{b / 2**30:.2f}" for b in rank_bytes(plan.pipeline.counts, placement)] == totals


def test_a_memory_limit_forces_another_split():
    """A limit just below what the fastest split needs on its busiest rank: the planner picks the fastest
    split that fits; without the limit it picks the other one."""
    free = load_plan(PP2_ZBV)
    whole = free.build_model()
    rank_bytes = SplitMemory(free.config, free.spec, free.model_args, whole, free.dims, "cuda",
                             free.n_microbatches).rank_bytes
    placement = [free.pipeline.stage_ids(r) for r in range(2)]
    need = max(rank_bytes(free.pipeline.counts, placement))
    limit_gib = need * 0.999 / 2**30
    limited = load_plan(PP2_ZBV + ["--parallelism.pipeline_parallel_memory_limit_gib", str(limit_gib)],
                        check_memory=False)
    assert limited.pipeline.counts != free.pipeline.counts
    assert max(rank_bytes(limited.pipeline.counts, placement)) <= limit_gib * 2**30
    # the fastest of the splits that fit, by the same simulation
    sim = Simulator(free.pipeline_costs, program_for("ZBVZeroBubble", 2, free.n_microbatches, 2))
    fitting = [c for c in (tuple(b - a for a, b in zip((0, *cuts, 6), (*cuts, 6)))
                           for cuts in itertools.combinations(range(1, 6), 3))
               if max(rank_bytes(c, placement)) <= limit_gib * 2**30]
    assert sim.predict(limited.pipeline.counts).makespan == min(sim.predict(c).makespan for c in fitting)
    with pytest.raises(ConfigError, match=r"pipeline_parallel_memory_limit_gib: none of the 10 splits"):
        load_plan(PP2_ZBV + ["--parallelism.pipeline_parallel_memory_limit_gib", "0.001"], check_memory=False)


def test_dry_run_predicts_each_rank_and_compares_given_split_points(tmp_path):
    args = PP2_ZBV + ["--job.dump_folder", str(tmp_path)]
    text = describe_plan(load_plan(args))
    assert "Split chosen by the planner (split_mode makespan; exact: all 10 contiguous splits simulated)" in text
    assert "pp rank  stages  compute  idle  bubble" in text and "step (makespan):" in text
    assert "measured costs: python -m trainer.measure_costs on one device" in text  # where to get better costs
    assert text.count("Next best: ") == 1 and text.split("Next best: ")[1].count("%)") == 3
    given = load_plan(args + ["--parallelism.pipeline_parallel_split_points", "layers.1,layers.3,layers.5"])
    plan = load_plan(args)
    sim = Simulator(plan.pipeline_costs, program_for("ZBVZeroBubble", 2, 8, 2))
    slower = sim.predict((1, 2, 2, 1)).makespan / sim.predict(plan.pipeline.counts).makespan - 1
    assert (f"predicted {100 * slower:.1f}% slower than the planner's choice"
            f" [{', '.join(plan.pipeline.split_points())}]") in describe_plan(given)
    # GFLOP/token printed with enough digits to be non-zero on the debug model
    assert "0.00 " not in text.split("fwd GFLOP/token")[1].split("pp rank")[0]


def test_next_best_prints_a_tie_within_rounding_as_plus_zero():
    """A runner-up a hair below the chosen split (a branch-and-bound tie) reads +0.0%, not -0.0%; real
    differences keep their sign."""
    from trainer.dry_run import _signed_percent

    assert _signed_percent(-1e-12) == _signed_percent(1e-12) == _signed_percent(-0.0004) == "+0.0%"
    assert _signed_percent(-0.051) == "-5.1%" and _signed_percent(0.031) == "+3.1%"


def test_flop_model_prices_attention_and_checkpointing():
    """One block of 10 matmul FLOPs and 4 attention FLOPs per token, 3 tokens: F = 42, I = 3 x (10 + 8) = 54,
    W = 30; under activation checkpointing the input-gradient pass runs the forward again (+42)."""
    flops = [(0.0, 0.0), (10.0, 4.0), (6.0, 0.0)]
    plain = flop_costs(flops, tokens=3, tp=1, recompute=[False], flops_per_second=1.0, send_bytes=8,
                       link_bytes_per_second=2, link_latency=1)
    assert plain.parts["F"] == (0.0, 42.0, 18.0) and plain.parts["I"] == (0.0, 54.0, 18.0)
    assert plain.parts["W"] == (0.0, 30.0, 18.0) and plain.parts["B"] == (0.0, 84.0, 36.0)
    assert plain.send == 1 + 8 / 2 and plain.unit == "s"
    ac = flop_costs(flops, tokens=3, tp=2, recompute=[True], flops_per_second=None, send_bytes=8,
                    link_bytes_per_second=2, link_latency=1)
    # tp 2 halves everything; relative units: the block's forward is 1; no transfers without a throughput
    assert ac.parts["F"] == pytest.approx((0.0, 1.0, 18 / 42)) and ac.parts["I"][1] == pytest.approx((27 + 21) / 21)
    assert ac.send == 0.0 and ac.unit == "units"


def test_memory_traffic_prices_the_loss_and_the_embeddings_gradient_by_their_bytes():
    """A 10-word vocabulary, width 4, 3 tokens: 30 logits. bf16 (2 bytes): the loss's forward 30 x (cast 2 + 4,
    log-softmax 12) = 540 bytes, its input gradient 30 x (16 + cast back 4 + 2) = 660. The embeddings' float32
    gradients, 4 passes of 4 bytes: (40 word + 12 position weights) x 16 = 832. fp32: no casts. tp 2 with the
    loss on shards halves the logits and the vocabulary-sized embedding only: (20 + 12) x 16 = 512."""
    from torch import nn

    from trainer.models.registry import ModelLayout
    from trainer.pipeline.cost import memory_bytes

    model = nn.Module()
    model.tok_embeddings, model.pos = nn.Embedding(10, 4), nn.Embedding(3, 4)
    model.output = nn.Linear(4, 10, bias=False)
    layout = ModelLayout(pre=("tok_embeddings", "pos"), post=("output",), dim=4, vocab_size=10)
    bf16 = memory_bytes(model, layout, tokens=3, tp=1, loss_sharded=False, dtype_bytes=2)
    assert bf16 == {"pre W": 832.0, "post F": 540.0, "post I": 660.0}
    assert memory_bytes(model, layout, tokens=3, tp=1, loss_sharded=False, dtype_bytes=4) == {
        "pre W": 832.0, "post F": 360.0, "post I": 480.0}
    assert memory_bytes(model, layout, tokens=3, tp=2, loss_sharded=True, dtype_bytes=2) == {
        "pre W": 512.0, "post F": 270.0, "post I": 330.0}
    assert memory_bytes(model, layout, tokens=3, tp=2, loss_sharded=False, dtype_bytes=2)["post F"] == 540.0
    # priced at 10 bytes/s beside 1 FLOP/s: added to the embedding's W and the output's F and I (B = I + W)
    flops = [(0.0, 0.0), (10.0, 4.0), (6.0, 0.0)]
    link = dict(send_bytes=8, link_bytes_per_second=2, link_latency=1)
    plain = flop_costs(flops, tokens=3, tp=1, recompute=[False], flops_per_second=1.0, **link)
    priced = flop_costs(flops, tokens=3, tp=1, recompute=[False], flops_per_second=1.0, memory=bf16,
                        memory_bytes_per_second=10.0, **link)
    assert priced.parts["W"] == pytest.approx((83.2, 30.0, 18.0))
    assert priced.parts["F"] == pytest.approx((0.0, 42.0, 72.0))
    assert priced.parts["I"] == pytest.approx((0.0, 54.0, 84.0))
    assert priced.parts["B"] == pytest.approx((83.2, 84.0, 102.0))
    assert plain.parts["F"] == (0.0, 42.0, 18.0) and "memory at 1e-08 GB/s" in priced.source
    # relative units (no throughput): FLOPs only
    assert flop_costs(flops, tokens=3, tp=1, recompute=[False], flops_per_second=None, memory=bf16,
                      memory_bytes_per_second=10.0, **link).parts["F"] == pytest.approx((0.0, 1.0, 18 / 42))


def test_a_job_with_a_memory_bandwidth_prices_its_loss_and_embedding_gradient():
    """The debug model at pp 2 (2048 words, width 256): the plan's costs with a bandwidth are the FLOPs-only ones
    plus the bytes over the bandwidth, and the dry run says which. The plan is for the job's accelerators: bf16
    compute casts the logits (18 and 22 bytes each); float32 does not (12 and 16). Tensor parallelism keeps the
    logits on vocabulary shards unless the loss gathers them; context parallelism halves a rank's tokens."""
    base = PP2_ZBV + ["--parallelism.pipeline_parallel_device_tflops", "0.1"]
    bandwidth = base + ["--parallelism.pipeline_parallel_device_memory_gbytes_per_second", "2"]
    plain = load_plan(base).pipeline_costs
    plan = load_plan(bandwidth)
    costs, config = plan.pipeline_costs, plan.config
    logits = config.training.seq_len * config.parallelism.pipeline_parallel_microbatch_size * 2048
    last = len(costs.parts["F"]) - 1
    added = {("W", 0): 4 * 2048 * 256 * 4, ("F", last): logits * 18, ("I", last): logits * 22}
    added[("B", 0)], added[("B", last)] = added[("W", 0)], added[("I", last)]
    for kind in KINDS:
        for part, seconds in enumerate(costs.parts[kind]):
            assert seconds == pytest.approx(plain.parts[kind][part] + added.get((kind, part), 0) / 2e9), (kind, part)
    fp32, fp32_plain = (load_plan(job + ["--training.mixed_precision_param", "float32"]).pipeline_costs
                        for job in (bandwidth, base))
    assert fp32.parts["F"][-1] - fp32_plain.parts["F"][-1] == pytest.approx(logits * 12 / 2e9)
    assert fp32.parts["I"][-1] - fp32_plain.parts["I"][-1] == pytest.approx(logits * 16 / 2e9)
    assert fp32.parts["W"][0] - fp32_plain.parts["W"][0] == pytest.approx(added[("W", 0)] / 2e9)
    tp = bandwidth + ["--parallelism.tensor_parallel_degree", "2"]
    sharded, gathered = (load_plan(tp + more).pipeline_costs for more in ([], ["--parallelism.disable_loss_parallel"]))
    assert gathered.parts["F"][-1] - sharded.parts["F"][-1] == pytest.approx(logits * 18 / 2 / 2e9)
    assert gathered.parts["W"][0] == sharded.parts["W"][0] == pytest.approx(added[("W", 0)] / 2 / 2e9)
    cp_job = ["--parallelism.context_parallel_degree", "2", "--model.attn_mask_type", "causal"]
    cp, cp_plain = (load_plan(job + cp_job).pipeline_costs for job in (bandwidth, base))
    assert cp.parts["F"][-1] - cp_plain.parts["F"][-1] == pytest.approx(logits * 18 / 2 / 2e9)
    text = describe_plan(plan)
    assert "memory at 2 GB/s" in text and "the loss and the embedding's gradient by their bytes" in text
    assert "set pipeline_parallel_device_memory_gbytes_per_second" in describe_plan(load_plan(base))


def test_a_block_priced_below_its_launch_time_is_named_in_the_dry_run():
    """The FLOP model in seconds prices a block's forward at its FLOPs over the throughput; under 0.2 ms (where
    eager blocks on GPUs were seen to cost their kernel launches, not their FLOPs) the dry run says so, once, with
    the price; at 0.21 ms, in relative units and with measured costs it says nothing."""
    from trainer.dry_run import LAUNCH_BOUND_BLOCK_S

    def block_s(tflops: float) -> tuple[float, str, JobPlan]:
        plan = load_plan(PP2_ZBV + ["--parallelism.pipeline_parallel_device_tflops", str(tflops)])
        blocks = plan.pipeline_costs.parts["F"][1:-1]
        return sum(blocks) / len(blocks), describe_plan(plan), plan

    at_one, _, _ = block_s(1.0)  # seconds per block forward at 1 TFLOP/s: the block's FLOPs / 1e12
    assert LAUNCH_BOUND_BLOCK_S == 2e-4
    fast, text, plan = block_s(at_one / 1.9e-4)
    assert fast == pytest.approx(1.9e-4)
    warned = [line for line in text.splitlines() if "a block's forward is priced at" in line]
    assert warned == ["(a block's forward is priced at 190.0 us at this throughput: under 0.2 ms a block's kernels take"
                      " longer to launch, one at a time, than to run, which FLOPs do not count, so these times and this"
                      " split can be far off; time the parts with python -m trainer.measure_costs)"], warned
    slow, text, _ = block_s(at_one / 2.1e-4)
    assert slow == pytest.approx(2.1e-4) and "a block's forward is priced at" not in text
    assert "a block's forward is priced at" not in describe_plan(load_plan(PP2_ZBV))
    # the same seconds, measured: a timed block is what it is, launches included
    plan.__dict__["pipeline_costs"] = replace(plan.pipeline_costs, source="measured (parts timed on one device)")
    assert "a block's forward is priced at" not in describe_plan(plan)


@pytest.mark.parametrize("counts", [(1, 2, 2, 1), (2, 1, 1, 2)])
def test_calibration_recovers_the_costs_that_made_the_measurements(counts):
    """Durations made from known seconds per kind (overhead + per unit x block units + pre + post; the first
    stage's whole backward in W, as torch runs it), with noise around the mean: the calibrated costs
    price this split and every other one as the known seconds do."""
    units = flop_costs([(0.0, 0.0)] + [(3.0, 1.0), (2.0, 1.0), (4.0, 1.0), (3.0, 1.0), (2.0, 1.0), (3.0, 1.0)]
                       + [(5.0, 0.0)], tokens=1, tp=1, recompute=[False] * 6, flops_per_second=None,
                       send_bytes=0, link_bytes_per_second=1, link_latency=0)
    truth = {"F": (0.002, 0.010, 0.001, 0.007), "I": (0.003, 0.012, 0.0, 0.006), "W": (0.001, 0.008, 0.002, 0.005)}
    parts = {k: (pre, *(per_unit * u for u in units.parts[k][1:-1]), post)
             for k, (_, per_unit, pre, post) in truth.items()}
    parts["B"] = tuple(i + w for i, w in zip(parts["I"], parts["W"]))
    known = PartCosts(parts, {k: truth[k][0] for k in "FIW"} | {"B": truth["I"][0] + truth["W"][0]}, 0.0, "s", "known")
    table = known.stage_table(counts)
    actions = [(k, s, table[KINDS.index(k)][s] * f) for k in "FIW" for s in range(4) for f in (0.97, 0.98, 1.05)]
    fitted = calibrated_costs(units, fit_costs(units, list(counts), actions), send=0.0, source="fit")
    for other in (counts, (3, 1, 1, 1), (1, 1, 1, 3)):
        want, got = known.stage_table(other), fitted.stage_table(other)
        for k in "FIW":
            # the first stage's fused backward (W) comes from the I and W of three stages, four unknowns
            # each, the weak prior pulling them: within one percent
            assert got[KINDS.index(k)] == pytest.approx(want[KINDS.index(k)], rel=1e-2 if k == "W" else 2e-3), \
                (other, k)
    # Two stages (pre + blocks, blocks + post) cannot separate four numbers: the fit still reproduces them.
    two = fit_costs(units, [3, 3], [(k, s, 0.05 + 0.02 * s + 0.01 * KINDS.index(k)) for k in "FB" for s in (0, 1)])
    table = calibrated_costs(units, two, send=0.0, source="fit").stage_table((3, 3))
    for k in "FB":
        assert table[KINDS.index(k)] == pytest.approx([0.05 + 0.01 * KINDS.index(k), 0.07 + 0.01 * KINDS.index(k)],
                                                      rel=1e-3)


def test_timed_block_boundaries_let_one_two_stage_run_price_every_split():
    """Two stages measure five numbers per kind (what every action costs before and after its blocks, a
    block, the embedding, the output) as two; with every stage's lead and tail timed at its block
    boundaries the fit recovers all five, so splits far from the measured one are priced as the known
    seconds price them (within 0.5%). Without the part times it must guess from the FLOP model (misses by
    over 5%); with only the first stage's lead and the last stage's tail (the embedding and the output,
    with the per-action cost in them) it cannot tell the per-action cost from a block's (over 1%)."""
    units = flop_costs([(0.0, 0.0)] + [(3.0, 1.0), (2.0, 1.0), (4.0, 1.0), (3.0, 1.0), (2.0, 1.0), (3.0, 1.0)]
                       + [(5.0, 0.0)], tokens=1, tp=1, recompute=[False] * 6, flops_per_second=None,
                       send_bytes=0, link_bytes_per_second=1, link_latency=0)
    # (lead overhead, tail overhead, per unit, pre, post): the embedding's gradient, the loss and the
    # per-action cost are what the FLOP model prices at nothing
    truth = {"F": (0.006, 0.004, 0.010, 0.004, 0.030), "B": (0.001, 0.004, 0.020, 0.009, 0.070)}
    parts = {k: (pre, *(per_unit * u for u in units.parts[k][1:-1]), post)
             for k, (_, _, per_unit, pre, post) in truth.items()}
    parts["I"], parts["W"] = parts["B"], parts["B"]  # not measured by this schedule, not compared
    known = PartCosts(parts, {k: truth[k][0] + truth[k][1] for k in "FB"} | {"I": 0.0, "W": 0.0}, 0.0, "s", "known")
    counts = [3, 3]
    table = known.stage_table(counts)
    actions = [(k, s, table[KINDS.index(k)][s]) for k in "FB" for s in (0, 1) for _ in range(4)]
    leads = [(k, s, "lead", truth[k][0] + truth[k][3] * (s == 0)) for k in "FB" for s in (0, 1)]
    tails = [(k, s, "tail", truth[k][1] + truth[k][4] * (s == 1)) for k in "FB" for s in (0, 1)]
    timed = calibrated_costs(units, fit_costs(units, counts, actions, leads + tails), send=0.0, source="fit")
    for other in ((1, 5), (5, 1), (2, 4)):
        want, got = known.stage_table(other), timed.stage_table(other)
        for k in "FB":
            assert got[KINDS.index(k)] == pytest.approx(want[KINDS.index(k)], rel=5e-3), (other, k)
    ends_only = [p for p in leads + tails if (p[1], p[2]) in ((0, "lead"), (1, "tail"))]
    for guess, missed_by in ((fit_costs(units, counts, actions), 0.05),
                             (fit_costs(units, counts, actions, ends_only), 0.01)):
        far = calibrated_costs(units, guess, send=0.0, source="fit").stage_table((1, 5))
        assert far[KINDS.index("F")][0] != pytest.approx(known.stage_table((1, 5))[KINDS.index("F")][0], rel=missed_by)


def test_timed_boundaries_keep_their_measured_values_when_the_stages_blocks_run_at_different_paces():
    """Stage 1's blocks run 10% slower than stage 0's (as a waiting rank's do on a shared CPU): durations and
    boundaries then disagree, and the fit keeps the directly timed per-action cost, pre and post (within 2%
    of what was timed) and puts the difference into a block's price, between the two stages' paces."""
    units = flop_costs([(0.0, 0.0)] + [(3.0, 1.0)] * 6 + [(5.0, 0.0)], tokens=1, tp=1, recompute=[False] * 6,
                       flops_per_second=None, send_bytes=0, link_bytes_per_second=1, link_latency=0)
    lead, tail, block, pre, post = 0.0012, 0.0039, 0.010, 0.006, 0.055  # seconds; block: stage 0's pace
    y = [lead + tail + 3 * block + pre, lead + tail + 3 * 1.1 * block + post]
    actions = [("B", s, y[s]) for s in (0, 1) for _ in range(4)]
    timed = [("B", 0, "lead", lead + pre), ("B", 1, "lead", lead),
             ("B", 0, "tail", tail), ("B", 1, "tail", tail + post)]
    fit = fit_costs(units, [3, 3], actions, timed)["B"]
    got = [fit["lead_overhead_s"], fit["tail_overhead_s"], fit["pre_s"], fit["post_s"]]
    assert got == pytest.approx([lead, tail, pre, post], rel=0.02)
    per_block = fit["per_unit_s"] * units.parts["B"][1]
    assert block < per_block < 1.1 * block


def test_a_cost_file_of_another_job_or_no_cost_file_is_one_line(tmp_path):
    bad = tmp_path / "costs.json"
    bad.write_text("{not json")
    with pytest.raises(ConfigError, match=r"^\[parallelism\] pipeline_parallel_cost_file: .*costs.json is not a"):
        load_plan(PP2_ZBV + ["--parallelism.pipeline_parallel_cost_file", str(bad)]).pipeline_costs
    with pytest.raises(ConfigError, match=r"^\[parallelism\] pipeline_parallel_cost_file: .*missing.json does not"):
        load_plan(PP2_ZBV + ["--parallelism.pipeline_parallel_cost_file", str(tmp_path / "missing.json")])
    other = tmp_path / "other.json"
    plan = load_plan(PP2_ZBV)
    from trainer.pipeline.cost import cost_identity

    identity = cost_identity(plan.config, plan.model_args.n_layers, 1, 1) | {"seq_len": 512}
    other.write_text(json.dumps({"version": 1, "job": identity, "measured": {}, "fit": {}}))
    with pytest.raises(ConfigError, match=r"measured with seq_len 512, this job has 256 \(\[training\] seq_len\)"):
        load_plan(PP2_ZBV + ["--parallelism.pipeline_parallel_cost_file", str(other)])


def _cost_file(identity: dict, **changes) -> dict:
    """A well-formed cost file for ``identity`` with ``changes`` (None: the entry removed) applied."""
    fit = {k: {"pre_s": 0.001, "post_s": 0.002, "per_unit_s": 1e-6, "overhead_s": 0.0} for k in ("F", "B")}
    data = {"version": 1, "job": identity, "measured": {"counts": [3, 3], "transfer_s": 1e-4}, "fit": fit}
    for path, value in changes.items():
        *parents, last = path.split("__")
        node = data
        for name in parents:
            node = node[name]
        if value is None:
            del node[last]
        else:
            node[last] = value
    return data


BAD_COST_FILES = {  # the file's content -> the words of its one line
    "a list": (lambda d: [d], r"is not a pipeline cost file written by a timed run \(a JSON array"),
    "nested 100,000 deep": (lambda d: "[" * 100_000 + "]" * 100_000, r"nested 100000 deep; at most 64"),
    "a kind that does not exist": (lambda d: _cost_file(d, fit__X={}), r"fit has an action kind 'X' \(known: F, B"),
    "pre_s missing": (lambda d: _cost_file(d, fit__F__pre_s=None), r"has no 'fit.F.pre_s'"),
    "a string for a number": (lambda d: _cost_file(d, fit__B__per_unit_s="1"),
                              r"fit.B.per_unit_s = '1': expected int or float"),
    "a negative cost": (lambda d: _cost_file(d, fit__F__post_s=-1.0), r"fit.F.post_s = -1.0: expected seconds from 0"),
    "a huge cost": (lambda d: _cost_file(d, fit__F__overhead_s=1e308), r"fit.F.overhead_s = 1e\+308: expected seconds"),
    "NaN": (lambda d: json.dumps(_cost_file(d)).replace('"per_unit_s": 1e-06', '"per_unit_s": NaN', 1),
            r"fit.F.per_unit_s = nan: must be a finite number"),
    "all costs zero": (lambda d: _cost_file(d, fit__F={"pre_s": 0, "post_s": 0, "per_unit_s": 0, "overhead_s": 0},
                                            fit__B={"pre_s": 0, "post_s": 0, "per_unit_s": 0, "overhead_s": 0}),
                       r"fit: every cost is 0 \(nothing to plan from\)"),
    "measured a list": (lambda d: _cost_file(d, measured=[1]), r"measured = \[1\]: expected dict"),
    "negative layer counts": (lambda d: _cost_file(d, measured__counts=[-3, 9]),
                              r"measured.counts = \[-3, 9\]: expected the blocks per stage"),
    "an infinite transfer": (lambda d: json.dumps(_cost_file(d, measured__transfer_s=7)).replace(
        '"transfer_s": 7', '"transfer_s": Infinity'), r"measured.transfer_s = inf: must be a finite number"),
}


@pytest.mark.parametrize("case", list(BAD_COST_FILES))
def test_a_malformed_cost_file_is_one_line_naming_the_entry(case, tmp_path):
    from trainer.pipeline.cost import cost_identity

    plan = load_plan(PP2_ZBV)
    identity = cost_identity(plan.config, plan.model_args.n_layers, 1, 1)
    content, words = BAD_COST_FILES[case]
    made = content(identity)
    path = tmp_path / "costs.json"
    path.write_text(made if isinstance(made, str) else json.dumps(made))
    with pytest.raises(ConfigError, match=r"^\[parallelism\] pipeline_parallel_cost_file: .*costs.json") as e:
        load_plan(PP2_ZBV + ["--parallelism.pipeline_parallel_cost_file", str(path)]).pipeline_costs
    assert re.search(words, str(e.value)) and "\n" not in str(e.value), str(e.value)


def test_the_well_formed_cost_file_of_these_cases_plans():
    """The cases above differ from this file by one entry each."""
    from trainer.pipeline.cost import cost_identity

    plan = load_plan(PP2_ZBV)
    import tempfile
    from pathlib import Path

    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "costs.json"
        path.write_text(json.dumps(_cost_file(cost_identity(plan.config, plan.model_args.n_layers, 1, 1))))
        costs = load_plan(PP2_ZBV + ["--parallelism.pipeline_parallel_cost_file", str(path)]).pipeline_costs
        assert costs.unit == "s" and costs.parts["F"][0] == pytest.approx(0.001)


@pytest.mark.parametrize("key, value", [("device_tflops", "1e-300"), ("device_tflops", "1e300"),
                                        ("link_gbytes_per_second", "1e-300")])
def test_a_device_speed_that_would_overflow_the_pricing_is_one_line(key, value):
    with pytest.raises(ConfigError, match=rf"\[parallelism\] pipeline_parallel_{key}: got .*, expected a number >="):
        load_plan(PP2_ZBV + [f"--parallelism.pipeline_parallel_{key}", value])


def test_given_split_points_over_the_memory_limit_are_said(caplog):
    load_plan(PP2_ZBV + ["--parallelism.pipeline_parallel_memory_limit_gib", "0.001",
                         "--parallelism.pipeline_parallel_split_points", "layers.1,layers.3,layers.5"],
              check_memory=False)
    assert re.search(r"pipeline_parallel_memory_limit_gib = 0.001: the split .* puts .* GiB on pp rank \d .*above"
                     r" the limit", caplog.text), caplog.text


def test_a_timed_run_writes_costs_that_a_dry_run_plans_with(tmp_path):
    """The calibration of a timed step (actions made from known per-stage seconds) writes the cost file; a
    dry run with it predicts in seconds, and the measured split's step equals the replay of those seconds."""
    import torch

    from trainer.pipeline.simulate import program_for
    from trainer.train import build_calibration

    plan = load_plan(PP2_ZBV)
    program = program_for("ZBVZeroBubble", 2, plan.n_microbatches, 2)
    calibration = build_calibration(plan, torch.device("cpu"), tmp_path, program)
    assert plan.pipeline.counts == (2, 1, 2, 1)
    # ms per action: F 1 + 4 per block (+3 output); I 0.5 + 5 per block (+2 output), nothing on stage 0;
    # W 0.5 + 3 per block (+2 output), and stage 0's W is its whole backward (torch's split backward)
    seconds = {"F": [9e-3, 5e-3, 9e-3, 8e-3], "I": [0.0, 5.5e-3, 10.5e-3, 7.5e-3],
               "W": [16.5e-3, 3.5e-3, 6.5e-3, 5.5e-3]}
    actions = [(k, s, v) for k, row in seconds.items() for s, v in enumerate(row) for _ in range(8)]
    # timed at the block boundaries: every action 0.6 ms before its blocks and 0.4 ms after them (F), 0.5 ms
    # before (I); the output's own part 3 ms forward, 2 ms input gradient; the embedding costs nothing
    # (the first stage's W is its whole backward: 0.5 + 0.5 ms before its blocks, nothing after); blocks:
    # F 4 ms, I 5 ms, the fused backward 8 ms
    counts = plan.pipeline.counts
    parts = [("F", s, "lead", 0.6e-3) for s in range(4)] + [("F", s, "tail", 0.4e-3 + 3e-3 * (s == 3))
                                                             for s in range(4)]
    parts += [("I", s, "lead", 0.5e-3) for s in (1, 2, 3)] + [("I", s, "tail", 2e-3 * (s == 3)) for s in (1, 2, 3)]
    parts += [("W", 0, "lead", 1e-3), ("W", 0, "tail", 0.0)]
    parts += [("F", s, "blocks", 4e-3 * counts[s]) for s in range(4)] + [("I", s, "blocks", 5e-3 * counts[s])
                                                                         for s in (1, 2, 3)]
    parts = parts * 8 + [("W", 0, "blocks", 8e-3 * counts[0])]
    text = calibration.add(5, actions, {0: 0.1, 1: 0.2}, 0.5, parts)
    assert "Bubble per pp rank measured 10.0%/20.0%" in text and str(tmp_path / "pipeline_costs.json") in text
    # what the boundaries timed: no first-stage I (it computes nothing), the fused backward B on the first
    # stage alone (its 1 ms lead divided between the per-action cost and the embedding by the weak prior)
    assert ("(outside the blocks, timed at their boundaries: F 1.00 ms per action, first stage's own part 0.00 ms,"
            " last stage's own part 3.00 ms; I 0.50 ms per action, last stage's own part 2.00 ms; B ") in text
    fused = re.search(r"; B ([\d.]+) ms per action, first stage's own part ([\d.]+) ms, per microbatch\); ", text)
    assert fused and float(fused[1]) + float(fused[2]) == pytest.approx(1.0, abs=0.011)
    # the fused backward ran on pp rank 0 only: no B figure to compare
    assert "; a block took F 4.00 / 4.00 ms, I 5.00 / 5.00 ms on pp rank 0 / 1 (the costs price" in text
    untimed = build_calibration(plan, torch.device("cpu"), tmp_path / "untimed", program).add(5, actions, {}, 0.5)
    assert "(the parts outside the blocks not timed: each stage divided as the FLOP model does)" in untimed
    assert "a block took" not in untimed
    measured = load_plan(PP2_ZBV + ["--parallelism.pipeline_parallel_cost_file", str(tmp_path / "pipeline_costs.json")])
    costs = measured.pipeline_costs
    assert costs.unit == "s" and costs.measured_counts == plan.pipeline.counts
    table = costs.stage_table(plan.pipeline.counts)
    for k, row in seconds.items():
        assert table[KINDS.index(k)] == pytest.approx(row, rel=0.01), k
    assert "Measured run's split" in describe_plan(measured)
    assert "set but unused" not in describe_plan(measured)
    rates = ["--parallelism.pipeline_parallel_device_tflops", "5",
             "--parallelism.pipeline_parallel_device_memory_gbytes_per_second", "100"]
    with_rates = load_plan(PP2_ZBV + rates + ["--parallelism.pipeline_parallel_cost_file",
                                              str(tmp_path / "pipeline_costs.json")])
    # the rates change nothing: every cost, the transfer, the split
    assert with_rates.pipeline_costs == costs and with_rates.pipeline.counts == measured.pipeline.counts
    assert ("(pipeline_parallel_device_tflops and pipeline_parallel_device_memory_gbytes_per_second set but unused:"
            " the measured costs are already seconds)") in describe_plan(with_rates)
    # a file an older version wrote, with each rank's bubble and block times beside the rest, plans alike
    data = json.loads((tmp_path / "pipeline_costs.json").read_text())
    older = tmp_path / "older.json"
    older.write_text(json.dumps({**data, "measured": {**data["measured"], "rank_bubble": [0.1, 0.2], "rank_block_s": {
        "forward": [4e-3, 4e-3], "backward": [5e-3, 5e-3]}}}))
    old = load_plan(PP2_ZBV + ["--parallelism.pipeline_parallel_cost_file", str(older)])
    assert replace(old.pipeline_costs, source="") == replace(costs, source="")
    assert old.pipeline.counts == measured.pipeline.counts


def test_the_transfer_time_is_fitted_to_the_measured_span():
    """A step simulated with a known transfer time: the fit finds that time from the step's length alone,
    and a span no longer than the compute gives no transfer time."""
    from trainer.pipeline.calibrate import fit_transfer

    costs = random_costs(random.Random(3), 6)
    program = program_for("ZBVZeroBubble", 2, 8, 2)
    with_transfers = Simulator(PartCosts(costs.parts, costs.overhead, 0.5, "s", "known"), program)
    # a split whose step the transfers lengthen (on some, the busiest rank hides them all)
    counts = next(c for c in splits_of(6, 4)
                  if with_transfers.predict(c).makespan > Simulator(costs, program).predict(c).makespan + 0.1)
    slow = with_transfers.predict(counts).makespan
    assert fit_transfer(costs, program, counts, slow) == pytest.approx(0.5, rel=1e-6)
    compute_only = Simulator(costs, program).predict(counts).makespan
    assert fit_transfer(costs, program, counts, compute_only * 0.99) == 0.0


def splits_of(n: int, stages: int) -> list[tuple[int, ...]]:
    return [tuple(b - a for a, b in zip((0, *cuts), (*cuts, n)))
            for cuts in itertools.combinations(range(1, n), stages - 1)]


def test_a_csv_schedule_is_planned_by_its_own_actions(tmp_path):
    """torch's Interleaved1F1B and InterleavedZeroBubble written out as CSVs: the planner chooses for each the split it
    chooses for the named schedule, with the same predicted step, and the two orders predict different steps."""
    from trainer.pipeline.simulate import lowered, schedule_ops

    base = ["--parallelism.pipeline_parallel_degree", "2", "--job.dump_folder", str(tmp_path)]
    steps = {}
    for schedule in ("Interleaved1F1B", "InterleavedZeroBubble"):
        rows = [[f"{s}{k}{m}" for k, s, m in q] for q in lowered(schedule_ops(schedule, 2, 8, 2))[0]]
        path = tmp_path / f"{schedule}.csv"
        path.write_text("\n".join(",".join(r) for r in rows) + "\n")
        named = load_plan(base + ["--parallelism.pipeline_parallel_schedule", schedule])
        csv = load_plan(base + ["--parallelism.pipeline_parallel_schedule_csv", str(path)])
        assert csv.pipeline.schedule == "csv" and csv.pipeline.counts == named.pipeline.counts
        steps[schedule] = csv.pipeline.search.best[0].makespan
        assert steps[schedule] == pytest.approx(named.pipeline.search.best[0].makespan, rel=1e-12)
        assert "Predicted step: csv" in describe_plan(csv)
    assert steps["Interleaved1F1B"] > steps["InterleavedZeroBubble"] * 1.01


def test_among_equal_steps_the_most_even_stages_win():
    """ZBV on 2 ranks, 4 stages, equal blocks and a heavy output: rank 0 (stages 0 and 3) decides the step,
    and rank 1 may divide its blocks between stages 1 and 2 any way without changing it. Of those ties the
    planner keeps the evenest division (smallest sum of squared stage loads), in both search paths."""
    parts = {"F": (0.0,) + (1.0,) * 12 + (20.0,), "I": (0.0,) + (1.0,) * 12 + (20.0,),
             "W": (0.0,) + (1.0,) * 12 + (20.0,)}
    parts["B"] = tuple(i + w for i, w in zip(parts["I"], parts["W"]))
    sim = Simulator(PartCosts(parts, {k: 0.0 for k in KINDS}, 0.0, "units", "test"),
                    program_for("ZBVZeroBubble", 2, 4, 2))
    # stage 1 up to 5 blocks: the step does not change (stage 1's first forward is off rank 0's path)
    ties = {c: sim.predict(c).makespan for c in ((1, a, 10 - a, 1) for a in range(1, 6))}
    assert len(set(ties.values())) == 1 and min(brute_force(sim)) == next(iter(ties.values()))
    for search in (search_splits(sim), search_splits(sim, budget=40, enumerate_up_to=0)):
        assert search.best[0].makespan == next(iter(ties.values()))
        assert search.best[0].counts == (1, 5, 5, 1), (search.exact, [p.counts for p in search.best])


def test_a_timed_runs_block_times_count_each_block_by_its_price(tmp_path):
    """The per-rank block times a timed run logs are seconds per mean block's price, not per block: with blocks
    the FLOP model prices 0.5, 1.5, 1, 1, 1.5, 0.5 (ZBV, split 2 / 1 / 2 / 1), rank 0 runs 3 blocks worth 2.5
    mean blocks forward, rank 1 3 blocks worth 3.5. Both ran 4 ms (forward) and 5 ms (input gradient) per mean
    block: the same pace, so the same figures on both ranks, where counting blocks made rank 1 look 40% slower."""
    import torch

    from trainer.train import build_calibration

    plan = load_plan(PP2_ZBV)
    program = program_for("ZBVZeroBubble", 2, plan.n_microbatches, 2)
    counts = plan.pipeline.counts
    assert counts == (2, 1, 2, 1)
    prices = (0.5, 1.5, 1.0, 1.0, 1.5, 0.5)

    calibration = build_calibration(plan, torch.device("cpu"), tmp_path, program)
    units = calibration.units
    calibration.units = replace(units, parts={k: (v[0], *(p * v[1] for p in prices), v[-1])
                                              for k, v in units.parts.items()})
    start = [1 + sum(counts[:s]) for s in range(4)]
    worth = [sum(prices[start[s] - 1:start[s] - 1 + c]) for s, c in enumerate(counts)]
    parts = [("F", s, "blocks", 4e-3 * worth[s]) for s in range(4)]
    parts += [("I", s, "blocks", 5e-3 * worth[s]) for s in (1, 2, 3)] + [("W", 0, "blocks", 8e-3 * worth[0])]
    actions = [(kind, s, t + 1e-3) for kind, s, _, t in parts]
    text = calibration.add(5, actions * 8, {0: 0.1, 1: 0.3}, 0.5, parts * 8)
    assert "a block took F 4.00 / 4.00 ms, I 5.00 / 5.00 ms on pp rank 0 / 1" in text


def test_compare_schedules_plans_every_schedule_with_the_planners_split(tmp_path):
    """--compare-schedules: each schedule of the table planned as its own job with split_mode makespan (not this
    plan's given split points or mode), predicted with the same costs, against this plan's predicted step, fastest
    first; a schedule the job cannot run says why, and configured layers per stage are kept where they fit."""
    from trainer.config.schedules import SCHEDULES
    from trainer.dry_run import _amount, _signed_percent, compare_schedules

    def table(lines: list[str]) -> list[list[str]]:  # the rows' cells: name, stages, step, vs, idle, memory
        start = next(i for i, line in enumerate(lines) if line.startswith("schedule ")) + 2
        return [re.split(r"\s{2,}", line.strip()) for line in lines[start:] if not line.startswith("Cannot run")]

    def step(p) -> float:
        return Simulator(p.pipeline_costs, program_for(p.pipeline.schedule, 2, p.n_microbatches,
                                                       p.pipeline.stages_per_rank)).predict(p.pipeline.counts).makespan

    # a large vocabulary: the output part and the loss's gradient make the last rank of a loop placement the fuller
    base = ["--parallelism.pipeline_parallel_degree", "2", "--training.local_batch_size", "2", "--job.dump_folder",
            str(tmp_path), "--model.overrides.vocab_size", "100000"]
    given = ["--parallelism.pipeline_parallel_schedule", "ZBVZeroBubble", "--parallelism.pipeline_parallel_split_mode",
             "flops", "--parallelism.pipeline_parallel_split_points", "layers.1,layers.2,layers.3"]
    plan = load_plan(base + given)
    lines = compare_schedules(plan, 2)
    rows = {cells[0]: cells for cells in table(lines)}
    this = step(plan)
    assert rows["ZBVZeroBubble (this plan)"][2:4] == [_amount(this, "units"), "+0.0%"]
    # 2 microbatches for 4 stages: DualPipeV refuses, naming why; every other schedule is planned
    refused = [line for line in lines if line.startswith("Cannot run here")]
    assert len(refused) == 1 and refused[0].startswith(
        "Cannot run here: DualPipeV: [parallelism] pipeline_parallel_schedule=DualPipeV with 2 microbatches")
    assert set(rows) == {"ZBVZeroBubble (this plan)"} | set(SCHEDULES) - {"DualPipeV"}
    fuller_last = False
    for name in set(SCHEDULES) - {"DualPipeV"}:
        alone = load_plan(base + ["--parallelism.pipeline_parallel_schedule", name,
                                  "--parallelism.pipeline_parallel_split_mode", "makespan"], check_memory=False)
        assert rows[name][1:4] == [str(alone.pipeline.num_stages), _amount(step(alone), "units"),
                                   _signed_percent(step(alone) / this - 1)], name
        pred = Simulator(alone.pipeline_costs, program_for(name, 2, 2, alone.pipeline.stages_per_rank)).predict(
            alone.pipeline.counts)
        assert rows[name][4] == f"{100 * max(pred.bubble(0), pred.bubble(1)):.1f}%", name
        # memory: the largest of the dry run's per-rank totals for that job
        memory = [line.split()[-1] for line in describe_plan(alone).split("total GiB\n")[1].splitlines()[1:3]]
        assert rows[name][5] == max(memory, key=float), name
        fuller_last |= float(memory[1]) > float(memory[0])
    assert fuller_last  # so the column is not rank 0's alone
    steps = [float(cells[2]) for cells in table(lines)]
    assert steps == sorted(steps) and step(plan) > min(steps)  # the given split is not the fastest here

    # configured layers per stage: kept where the schedule allows them (1 a stage: 6 stages, 3 a rank), else the
    # schedule's default (V: 2 stages a rank; 1F1B: 1)
    per_stage = load_plan(base + ["--parallelism.pipeline_parallel_schedule", "Interleaved1F1B",
                                  "--parallelism.pipeline_parallel_layers_per_stage", "1"])
    lines = compare_schedules(per_stage, 2)
    stages = {cells[0]: cells[1] for cells in table(lines)}
    assert stages["LoopedBFS"] == "6" and stages["ZBVZeroBubble"] == "4" and stages["1F1B"] == "2"
    # DualPipeV fits neither way (3 stages a rank; 2 microbatches for 4 stages): both reasons, in that order
    dual = next(line for line in lines if line.startswith("Cannot run here: DualPipeV"))
    assert "needs exactly 2 stages per rank, got 3; with the schedule's own stage count: " in dual
    assert dual.endswith("at least as many microbatches as stages, but got 2 microbatches and 4 stages.")


@pytest.mark.parametrize("case", ["memory limit", "per-op checkpointing", "csv schedule", "planner's own split"])
def test_compare_schedules_refuses_exactly_what_each_schedules_own_plan_refuses(tmp_path, case):
    """Each schedule's row, or its "Cannot run here" line, is what that schedule's own plan (config checks included)
    gives: under a memory limit some schedules fit no split; per-op selective checkpointing rules out the zero-bubble
    ones; a configured CSV schedule is this plan, every named schedule is planned; a plan that is the planner's own
    choice is not listed twice."""
    from trainer.config.schedules import SCHEDULES
    from trainer.dry_run import _amount, compare_schedules

    base = ["--parallelism.pipeline_parallel_degree", "2", "--job.dump_folder", str(tmp_path)]
    given = {"memory limit": ["--model.overrides.vocab_size", "100000",
                              "--parallelism.pipeline_parallel_memory_limit_gib", "0.75"],
             "per-op checkpointing": ["--activation_checkpoint.mode", "selective",
                                      "--activation_checkpoint.selective_ac_option", "op"],
             "csv schedule": [], "planner's own split": []}[case]
    configured = []
    if case == "csv schedule":
        from trainer.pipeline.simulate import lowered, schedule_ops

        path = tmp_path / "interleaved.csv"
        path.write_text("\n".join(",".join(f"{s}{k}{m}" for k, s, m in q)
                                  for q in lowered(schedule_ops("Interleaved1F1B", 2, 8, 2))[0]) + "\n")
        configured = ["--parallelism.pipeline_parallel_schedule_csv", str(path)]
    plan = load_plan(base + given + configured, check_memory=False)
    lines = compare_schedules(plan, 2)
    start = next(i for i, line in enumerate(lines) if line.startswith("schedule ")) + 2
    rows = {cells[0]: cells for cells in (re.split(r"\s{2,}", line.strip()) for line in lines[start:]
                                          if not line.startswith("Cannot run here"))}
    refused = {line.split(": ")[1]: line.split(": ", 2)[2] for line in lines if line.startswith("Cannot run here")}
    assert f"{plan.pipeline.schedule} (this plan)" in rows
    if case == "memory limit":  # what the limit bounds is what the column shows
        assert all(float(cells[5]) <= 0.75 for cells in rows.values())
    for name in SCHEDULES:
        try:
            alone = load_plan(base + given + ["--parallelism.pipeline_parallel_schedule", name], check_memory=False)
        except ConfigError as e:
            assert refused.pop(name) == str(e), name
            continue
        sim = Simulator(alone.pipeline_costs,
                        program_for(name, 2, alone.n_microbatches, alone.pipeline.stages_per_rank))
        if (name, alone.pipeline.counts) == (plan.pipeline.schedule, plan.pipeline.counts):
            assert name not in rows  # the plan's own row is it
            continue
        assert rows.pop(name)[2] == _amount(sim.predict(alone.pipeline.counts).makespan, "units"), name
    assert refused == {} and list(rows) == [f"{plan.pipeline.schedule} (this plan)"]
    # each case refuses what it is about: a schedule for memory (at least one), every split-backward one for
    # per-op checkpointing
    zero_bubble = sum(t.split_backward for t in SCHEDULES.values())
    least = {"memory limit": 1, "per-op checkpointing": zero_bubble, "csv schedule": 0, "planner's own split": 0}
    assert sum(line.startswith("Cannot run here") for line in lines) >= least[case]
    if case == "memory limit":
        assert "no split over the memory limit of 0.75 GiB" in lines[0]
