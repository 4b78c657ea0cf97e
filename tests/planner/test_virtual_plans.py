"""The planner with several stage chunks per rank: it picks chunks when the simulator
predicts them faster and keeps one stage per rank otherwise, gives a slow rank's chunks less
work, keeps the user's pins, refuses a model too small for the chunks, its plan table says
what it chose, and the options reach every schedule by name."""

from __future__ import annotations

import re
from dataclasses import replace

import pytest

from lightning_autopipe.cluster import Cluster
from lightning_autopipe.errors import OptionError, PlanError
from lightning_autopipe.options import AutoPipeOptions
from lightning_autopipe.planner import make_plan
from lightning_autopipe.planner.generators import AUTO_SCHEDULES, GENERATORS
from lightning_autopipe.planner.layout import BlockCosts
from lightning_autopipe.planner.plan import Proposal
from lightning_autopipe.planner.report import format_plan
from lightning_autopipe.planner.search import finish_plan
from lightning_autopipe.planner.simulate import simulate
from lightning_autopipe.planner.vcost import ChunkLayout
from lightning_autopipe.planner.vsearch import chunk_cuts
from lightning_autopipe.profile import BlockProfile, Profile

ALL = AUTO_SCHEDULES


def _profile(n: int = 32, act: int = 10**5) -> Profile:
    return Profile("m", 4, "ref", [
        BlockProfile(f"b{i}", 1.0, 2.0, 10**6, 10**6, act, forward_fixed_ms=0.3,
                     backward_fixed_ms=0.3) for i in range(n)])


def _cluster(n: int, gbps: float = 100, slow: int = 0) -> Cluster:
    servers = [{"name": "f", "gpus": n - slow, "device": {"name": "d", "speed": 1.0,
                                                         "memory_gb": 80},
                "levels": [{"size": n - slow, "gbps": gbps, "latency_us": 5}]}]
    if slow:
        servers.append({"name": "s", "gpus": slow, "device": {"name": "slow", "speed": 0.5,
                                                             "memory_gb": 80},
                        "levels": [{"size": slow, "gbps": gbps, "latency_us": 5}]})
    return Cluster.from_dict({"name": "c", "network_gbps": gbps, "servers": servers})


def test_auto_chooses_chunks_when_the_simulator_predicts_them_faster():
    prof, cl = _profile(), _cluster(8)
    kw = dict(num_stages=8, replicas=1, num_microbatches=8)
    one = make_plan(prof, cl, 64, **kw)
    auto = make_plan(prof, cl, 64, schedules=ALL, **kw)
    assert one.chunks_per_rank == 1
    assert (auto.schedule, auto.chunks_per_rank, auto.placement) == ("zbv", 2, "v")
    assert auto.num_stages == 16
    assert auto.num_ranks == 8
    # the reference: both plans replayed by the simulator, the chunked one is faster
    again = simulate(auto, prof, cl).iteration_ms
    assert again == pytest.approx(auto.iteration_ms)
    assert again < 0.95 * simulate(one, prof, cl).iteration_ms
    note = next(n for n in auto.search_notes if n.startswith("chose zbv with 2 chunks per rank"))
    # the search simulated no one-stage-per-rank plan: the note's lower bound holds for the
    # best of them (planned without chunks), and a simulation is not spent on the note
    bound = re.search(r"no plan with one stage per rank can beat ([0-9.]+) ms", note)
    assert bound, note
    assert one.iteration_ms >= float(bound.group(1)) > auto.iteration_ms
    table = format_plan(auto, prof, cl)
    assert "8 ranks x 2 chunks x 1 replicas" in table
    assert "2 chunks per rank (v placement), rank -> chunks: rank 0: [0, 15]" in table
    assert "chunk  blocks" in table
    # interleaved only: looped placement, still faster than plain 1F1B here
    inter = make_plan(prof, cl, 64, schedules=("1f1b", "interleaved-1f1b"), **kw)
    plain = make_plan(prof, cl, 64, schedules=("1f1b",), **kw)
    assert (inter.schedule, inter.placement) == ("interleaved-1f1b", "looped")
    assert inter.iteration_ms < plain.iteration_ms


def test_one_stage_per_rank_stays_when_chunks_would_be_slower():
    # big activations over slow links: every chunk boundary is a transfer, twice as many
    prof, cl = _profile(act=4 * 10**7), _cluster(4, gbps=10)
    kw = dict(num_stages=4, replicas=1, num_microbatches=16)
    auto = make_plan(prof, cl, 64, schedules=ALL, **kw)
    assert auto.chunks_per_rank == 1
    # the reference: the same ranks with chunks, as the planner would cut them, simulate slower
    costs = BlockCosts.from_profile(prof, cl)
    groups = [list(st.devices) for st in auto.stages]
    for schedule, pl in (("zbv", "v"), ("interleaved-1f1b", "looped")):
        cuts = chunk_cuts(costs, ChunkLayout.from_cluster(cl, groups, 2, pl))
        prop = Proposal(groups, cuts, 16, 1, 1, schedule, 2, pl)
        chunked = finish_plan(prop, "t", prof, cl, 64)
        assert chunked.iteration_ms > auto.iteration_ms, schedule


def test_a_slow_ranks_chunks_get_less_work():
    prof, cl = _profile(48), _cluster(4, slow=1)
    plan = make_plan(prof, cl, 64, num_stages=4, replicas=1, num_microbatches=8,
                     schedules=("zbv",))
    assert plan.chunks_per_rank == 2
    slow = next(r for r in range(4) if plan.rank_devices(r)[0].startswith("s:"))
    work = [sum(plan.stages[c].blocks[1] - plan.stages[c].blocks[0]
                for c in plan.rank_stages(r)) for r in range(4)]
    fast = [w for r, w in enumerate(work) if r != slow]
    assert work[slow] < 0.75 * min(fast), work
    assert sum(work) == 48
    # the reference: the same plan with every chunk the same size simulates slower
    even = replace(plan, stages=list(plan.stages)).with_cuts(list(range(0, 49, 6)))
    assert simulate(even, prof, cl).iteration_ms > plan.iteration_ms


def test_chunk_cuts_share_work_by_rank_speed():
    prof, cl = _profile(40), _cluster(4, slow=2)
    costs = BlockCosts.from_profile(prof, cl)
    groups = [["f:0"], ["s:0"], ["f:1"], ["s:1"]]
    for v, pl in ((2, "v"), (2, "looped"), (3, "looped")):
        lay = ChunkLayout.from_cluster(cl, groups, v, pl)
        cuts = chunk_cuts(costs, lay)
        assert len(cuts) == 4 * v + 1
        size = [cuts[c + 1] - cuts[c] for c in range(4 * v)]
        per_rank = [sum(size[c] for c in range(4 * v) if lay.owner[c] == r) for r in range(4)]
        # speeds 1 : 0.5: fast ranks 2/6 of 40 blocks each, slow ranks 1/6 (within rounding)
        assert per_rank[0] == pytest.approx(40 / 3, abs=v)
        assert per_rank[1] == pytest.approx(40 / 6, abs=v)


def test_the_timeline_picture_and_trace_name_the_chunks(tmp_path):
    pytest.importorskip("matplotlib")
    from lightning_autopipe.planner.timeline import chrome_trace, write_png

    prof, cl = _profile(), _cluster(4)
    plan = make_plan(prof, cl, 32, num_stages=4, replicas=1, num_microbatches=4,
                     schedules=("zbv",))
    res = simulate(plan, prof, cl)
    write_png(res, tmp_path / "timeline.png")
    assert (tmp_path / "timeline.png").stat().st_size > 1000
    names = {e["name"] for e in chrome_trace(res)["traceEvents"] if e.get("ph") == "X"}
    assert {"0F0.0", "7F0.0", "7B0.0", "3F0.0", "4F0.0"} <= names  # both chunks of each rank
    assert {e.stage for e in res.events if e.device == plan.rank_devices(0)[0]} == {0, 7}


@pytest.mark.parametrize("schedule", ["zbv", "interleaved-1f1b"])
def test_chunked_plans_keep_the_pinned_microbatches_and_slices(schedule):
    prof, cl = _profile(), _cluster(4)
    free = make_plan(prof, cl, 64, num_stages=4, replicas=1, schedules=(schedule,))
    pins = dict(num_microbatches=4, startup_slices=4, drain_slices=4)
    # the reference: left free, the search chooses other counts (so the pins are what holds)
    assert (free.num_microbatches, free.startup_slices, free.drain_slices) != (4, 4, 4)
    for schedules in ((schedule,), ALL):
        plan = make_plan(prof, cl, 64, num_stages=4, replicas=1, schedules=schedules, **pins)
        assert (plan.num_microbatches, plan.startup_slices, plan.drain_slices) == (4, 4, 4)
    pinned = make_plan(prof, cl, 64, num_stages=4, replicas=1, schedules=(schedule,), **pins)
    assert (pinned.chunks_per_rank > 1, pinned.schedule) == (True, schedule)
    assert simulate(pinned, prof, cl).iteration_ms == pytest.approx(pinned.iteration_ms)


def test_a_pinned_chunked_schedule_refuses_a_model_with_too_few_blocks():
    prof, cl = _profile(6), _cluster(4)
    for schedule in ("zbv", "interleaved-1f1b"):
        with pytest.raises(PlanError, match=r"4 pipeline ranks \(8 chunks\).* 6 blocks.*"
                                            r"num_stages <= 3.*'1f1b'"):
            make_plan(prof, cl, 64, num_stages=4, replicas=1, schedules=(schedule,))
    # enough blocks at 3 stages (6 chunks); auto falls back to one stage per rank at 4
    assert make_plan(prof, cl, 48, num_stages=3, replicas=1,
                     schedules=("zbv",)).chunks_per_rank == 2
    assert make_plan(prof, cl, 64, num_stages=4, replicas=1, schedules=ALL).chunks_per_rank == 1


def test_no_chunks_without_a_pipeline_unless_only_chunked_schedules_are_allowed():
    prof, cl = _profile(8), _cluster(2)
    auto = make_plan(prof, cl, 64, num_stages=1, replicas=2, schedules=ALL)
    assert (auto.chunks_per_rank, auto.num_stages) == (1, 1)
    only = make_plan(prof, cl, 64, num_stages=1, replicas=2, schedules=("zbv",))
    assert (only.schedule, only.chunks_per_rank, only.num_ranks) == ("zbv", 2, 1)


def test_the_options_take_every_schedule_by_name_and_auto_considers_chunks():
    for name in GENERATORS:
        assert AutoPipeOptions(schedule=name).schedules == (name,)
    assert AutoPipeOptions(replan="off").schedules == AUTO_SCHEDULES
    # live re-planning (the default) switches between one-chunk layouts only
    assert AutoPipeOptions().schedules == ("1f1b", "zb-h1")
    assert {"interleaved-1f1b", "zbv"} <= set(AUTO_SCHEDULES) < set(GENERATORS)
    with pytest.raises(OptionError, match="schedule must be 'auto' or one of") as err:
        AutoPipeOptions(schedule="zb-v")
    for name in GENERATORS:
        assert repr(name) in str(err.value)


@pytest.mark.parametrize(("schedule", "v"), [("interleaved-1f1b", 2), ("zbv", 2),
                                             ("interleaved-1f1b", 3)])
def test_small_models_get_the_simulators_best_chunk_cuts_and_slices(schedule, v):
    """A model small enough to price every choice gets the simulator's optimum: every
    contiguous cut into 2 v chunks and every startup and drain slice count in {1, 2}, each
    simulated, none faster than the chunks the search picks (ranks of two speeds, links with
    latency only, where the fast model and the simulator agree; the walk from the speed-
    proportional cuts stopped up to several percent above it on such models)."""
    import itertools
    import random

    from lightning_autopipe.planner.vsearch import _chunked

    from .test_pricing import _latency_only_cluster
    from .test_pricing import _profile as random_profile

    cluster = _latency_only_cluster(1)
    groups = [[d.name] for d in cluster.devices]
    placement = GENERATORS[schedule].placement
    for seed in range(6):
        rng = random.Random(f"{schedule}-{v}-{seed}")
        prof = random_profile(rng, rng.randint(2 * v + 3, 2 * v + 6))
        costs = BlockCosts.from_profile(prof, cluster)
        n, m, batch = costs.num_blocks, 4, 32
        _, prop = _chunked(costs, cluster, Proposal(groups, [0, 1, n], m, 2), batch, 2.0,
                           schedule, v)
        ours = finish_plan(prop, "autopipe", prof, cluster, batch).iteration_ms
        best = min(
            finish_plan(Proposal(groups, [0, *inner, n], m, k, j, schedule, v, placement),
                        "every", prof, cluster, batch).iteration_ms
            for inner in itertools.combinations(range(1, n), 2 * v - 1)
            for k in (1, 2) for j in (1, 2))
        assert ours <= best * (1 + 1e-9), (seed, n, prop.cuts, ours, best)


def test_the_choice_note_says_when_the_other_kind_was_simulated_but_does_not_fit():
    from types import SimpleNamespace

    from lightning_autopipe.planner.vsearch import choice_note

    best = SimpleNamespace(chunks_per_rank=1, schedule="zb-h1", iteration_ms=120.0)
    chunked = SimpleNamespace(chunks_per_rank=2, schedule="zbv", iteration_ms=100.0)
    never = lambda p: pytest.fail("a simulated kind needs no bound")  # noqa: E731
    note, = choice_note(best, [best], [], never, simulated=[best, chunked])
    assert note == ("chose zb-h1 with one stage per rank: predicted 120.0 ms; no plan with "
                    "several chunks per rank that the search simulated fits device memory")
    note, = choice_note(best, [best, chunked], [], never, simulated=[best, chunked])
    assert "against 100.0 ms for the best zbv with 2 chunks per rank" in note
