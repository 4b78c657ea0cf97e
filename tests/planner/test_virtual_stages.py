"""Several stage chunks per rank in the schedule IR: placement, the interleaved 1F1B and ZB-V
generators, lowering with local hand-offs, the validator (accepts the generators over the
grid, refuses broken variants), the grid and the ASCII timeline."""

from __future__ import annotations

import itertools

import pytest

from lightning_autopipe.errors import PlanError, ScheduleError
from lightning_autopipe.planner.ascii import ascii_timeline
from lightning_autopipe.planner.generators import GENERATORS, build_schedule, generate
from lightning_autopipe.planner.placement import chunk_rank, chunk_ranks, rank_chunks
from lightning_autopipe.planner.plan import Plan, StagePlan
from lightning_autopipe.planner.replay import format_grid, inflight_per_rank, validate
from lightning_autopipe.planner.schedule import (
    Action,
    Kind,
    format_schedule,
    lower_communication,
    one_f_one_b,
    parse_schedule,
)
from lightning_autopipe.planner.zbv import greedy_schedule

#: (schedule, chunks per rank, placement, in-flight bound in chunk micro-batches for p ranks)
FAMILIES = [
    ("interleaved-1f1b", 1, "looped", lambda p: p),
    ("interleaved-1f1b", 2, "looped", lambda p: 2 * p),
    ("interleaved-1f1b", 3, "looped", lambda p: 3 * p),
    ("zbv", 2, "v", lambda p: 2 * p),
]
SHAPES = [(m, k, j) for m, k, j in itertools.product(range(1, 13), range(1, 5), range(1, 5))
          if j == 1 or m >= 2]


def test_placements_map_chunks_to_ranks():
    assert chunk_ranks(4, 2, "looped") == (0, 1, 2, 3, 0, 1, 2, 3)
    assert chunk_ranks(4, 2, "v") == (0, 1, 2, 3, 3, 2, 1, 0)
    assert chunk_ranks(3, 3, "v") == (0, 1, 2, 2, 1, 0, 0, 1, 2)  # zigzag beyond two
    assert rank_chunks(1, 4, 2, "v") == [1, 6]
    assert rank_chunks(0, 3, 3, "looped") == [0, 3, 6]
    for p, v, pl in itertools.product(range(1, 6), range(1, 4), ("looped", "v")):
        owner = chunk_ranks(p, v, pl)
        assert sorted(owner) == sorted(list(range(p)) * v)  # v chunks on every rank
        assert all(c in rank_chunks(chunk_rank(c, p, v, pl), p, v, pl) for c in range(p * v))
    assert chunk_ranks(5, 1, "v") == tuple(range(5))  # one chunk: chunk == rank
    with pytest.raises(ScheduleError, match="unknown placement 'w'"):
        chunk_ranks(2, 2, "w")
    with pytest.raises(ScheduleError, match="chunk 8 is outside 0..7"):
        chunk_rank(8, 4, 2)


@pytest.mark.parametrize("ranks", range(2, 9))
def test_the_validator_accepts_every_generator_over_the_grid(ranks):
    """p 2-8 x v 1-3 x m 1-12 x startup and drain slices 1-4, each within its memory bound."""
    for (name, v, pl, bound), (m, k, j) in itertools.product(FAMILIES, SHAPES):
        sch = generate(name, ranks, m, k, j, v)
        assert sorted(sch) == list(range(ranks))
        validate(sch, m, k, j, chunks_per_rank=v, placement=pl, max_inflight=bound(ranks))


def test_interleaved_with_one_chunk_is_1f1b():
    for p, (m, k, j) in itertools.product(range(1, 7), SHAPES[::3]):
        assert generate("interleaved-1f1b", p, m, k, j, 1) == one_f_one_b(p, m, k, j)


def test_interleaved_runs_megatrons_rounds():
    # 2 ranks, 2 chunks: rank 0 holds chunks 0 and 2 and forwards a round of 2 micro-batches
    # on chunk 0, then on chunk 2; backwards go chunk 2 first
    sch = generate("interleaved-1f1b", 2, 4, 1, 1, 2)
    assert format_schedule(sch) == (
        "0: 0F0.0 0F1.0 2F0.0 2F1.0 2B0.0 0F2.0 2B1.0 0F3.0 0B0.0 2F2.0 0B1.0 2F3.0 2B2.0 "
        "2B3.0 0B2.0 0B3.0\n"
        "1: 1F0.0 1F1.0 3F0.0 3B0.0 3F1.0 3B1.0 1F2.0 1B0.0 1F3.0 1B1.0 3F2.0 3B2.0 3F3.0 "
        "3B3.0 1B2.0 1B3.0")


def test_hand_computed_small_v():
    """ZB-V on 2 ranks, m = 2, one tick per F, B and W (worked out by hand from the rules of
    planner/zbv.py): rank 0 forwards chunk 0 twice, idles one tick until micro-batch 0 comes
    back up the V, runs the loss chunk 3's F and B back to back; 13 ticks in all."""
    sch = generate("zbv", 2, 2, 1, 1, 2)
    assert format_schedule(sch) == (
        "0: 0F0.0 0F1.0 3F0.0 3B0.0 3F1.0 3B1.0 0B0.0 0W0.0 0B1.0 3W0.0 0W1.0 3W1.0\n"
        "1: 1F0.0 2F0.0 1F1.0 2F1.0 2B0.0 1B0.0 2B1.0 1B1.0 1W0.0 2W0.0 1W1.0 2W1.0")
    assert ascii_timeline(sch, 1, 1, 2).splitlines() == [
        "rank 0 |01.0a1baAbABB",
        "rank 1 |.0011aabbAABB",
    ]
    # two ticks per F: the second chunk of a rank continues with '+', its W with '^'
    assert ascii_timeline(sch, 1, 2, 4).splitlines()[0] == "rank 0 |0-1-..0+a#1+b#a=A~b=A^B~B^"


def _ticks(sch, forward, backward) -> int:
    return max(len(r.split("|")[1]) for r in ascii_timeline(sch, 1, forward, backward)
               .splitlines())


def test_chunks_shrink_the_bubble_on_a_balanced_pipeline():
    """One tick per chunk F, B and W (a stage of two chunks: two); the ideal step is 6 m ticks.
    ZB-V's bubble is at most 0.7 of ZB-H1's once m >= 2 p (about half: fill and drain run on
    half-stages), interleaved 1F1B's below 1F1B's."""
    for p, m in itertools.product((2, 3, 4, 6, 8), (2, 4, 8, 12, 16)):
        ideal = 6 * m
        zbv = _ticks(generate("zbv", p, m, 1, 1, 2), 1, 2) - ideal
        h1 = _ticks(generate("zb-h1", p, m), 2, 4) - ideal
        inter = _ticks(generate("interleaved-1f1b", p, m, 1, 1, 2), 1, 2) - ideal
        plain = _ticks(generate("1f1b", p, m), 2, 4) - ideal
        assert 0 < zbv < h1, (p, m, zbv, h1)
        assert inter < plain, (p, m, inter, plain)
        if m >= 2 * p:
            assert zbv <= 0.7 * h1, (p, m, zbv, h1)


def test_lowering_hands_over_locally_between_chunks_of_one_rank():
    low = lower_communication(generate("zbv", 3, 2, 1, 1, 2))
    # the V turns on rank 2 (chunks 2 and 3): no send or receive between them
    texts = {str(a) for acts in low.values() for a in acts}
    assert not {"2SF0.0", "3RF0.0", "3SB0.0", "2RB0.0"} & texts
    assert {"1SF0.0", "2RF0.0", "3SF0.0", "4RF0.0", "5SB1.0", "4RB1.0"} <= texts
    assert "0RF0.0" not in texts
    assert "5SF0.0" not in texts
    # looped on one rank: every hand-off is local
    one = lower_communication(generate("interleaved-1f1b", 1, 3, 1, 1, 3))
    assert all(a.kind.is_compute for a in one[0])
    validate(one, 3, 1, chunks_per_rank=3)


def _rejects(sch, m, k, why, **kw) -> str:
    with pytest.raises(ScheduleError, match=why) as err:
        validate(sch, m, k, **kw)
    marked = [ln for ln in str(err.value).splitlines() if ">" in ln and "<" in ln]
    assert marked, str(err.value)
    return marked[0].split(">")[1].split("<")[0]


V = dict(chunks_per_rank=2, placement="v")


def test_the_validator_refuses_broken_chunk_schedules():
    good = generate("zbv", 2, 2, 1, 1, 2)
    # a chunk listed on the wrong rank
    sch = {r: list(a) for r, a in good.items()}
    sch[1][0] = Action(3, Kind.FORWARD, 0)
    assert _rejects(sch, 2, 1, "3F0.0 is listed under rank 1", **V) == "3F0.0"
    # looped placement claimed for a V schedule
    with pytest.raises(ScheduleError, match="listed under rank 0"):
        validate(good, 2, 1, chunks_per_rank=2, placement="looped")
    # the local hand-off out of order: chunk 2 forwards before chunk 1 on the same rank
    sch = {r: list(a) for r, a in good.items()}
    sch[1][0], sch[1][1] = sch[1][1], sch[1][0]
    assert _rejects(sch, 2, 1, r"runs 2F0.0 before its local input 1F0.0", **V) == "2F0.0"
    # a gradient handed over locally before it exists
    sch = parse_schedule(format_schedule(good).replace("2B0.0 1B0.0", "1B0.0 2B0.0"))
    assert _rejects(sch, 2, 1, "before its local gradient 2B0.0", **V) == "1B0.0"
    # W before B on a chunk; a chunk missing its W
    sch = parse_schedule(format_schedule(good).replace("0B0.0 0W0.0", "0W0.0 0B0.0"))
    assert _rejects(sch, 2, 1, "0W0.0 before its input backward 0B0.0", **V) == "0W0.0"
    sch = parse_schedule(format_schedule(good).replace(" 3W1.0", ""))
    with pytest.raises(ScheduleError, match=r"chunk 3 \(rank 0\) lacks 3W1.0"):
        validate(sch, 2, 1, **V)
    # a deadlock across the V: rank 0 waits for the gradient of micro-batch 0 before it
    # runs the loss chunk that produces it
    sch = parse_schedule(format_schedule(good).replace(
        "3F0.0 3B0.0 3F1.0 3B1.0 0B0.0", "0B0.0 3F0.0 3B0.0 3F1.0 3B1.0"))
    assert _rejects(sch, 2, 1, "deadlock", **V) in ("0B0.0", "2B0.0")
    # the in-flight bound: ZB-V holds both micro-batches on both chunks of a rank at once
    # (2 p = 4 chunk micro-batches, held until each W)
    held = inflight_per_rank(good, 2, 1)
    assert max(held[0]) == 4
    assert max(held[1]) == 4
    assert held[0][:6] == [1, 2, 3, 3, 4, 4]
    assert _rejects(good, 2, 1, "rank 0 holds 4 chunk micro-batches .* over its bound of 3",
                    max_inflight=3, **V) == "3F1.0"
    assert _rejects(good, 2, 1, "rank 1 holds 4", max_inflight=[4, 3], **V) == "2F1.0"
    with pytest.raises(ScheduleError, match=r"peak \| 4 +4"):
        validate(good, 2, 1, max_inflight=3, **V)


def _raises(sch, m, k, **kw) -> str:
    with pytest.raises(ScheduleError) as err:
        validate(sch, m, k, **kw)
    return str(err.value)


def test_the_validator_refuses_broken_lowered_chunk_schedules():
    low = lower_communication(generate("zbv", 2, 2, 1, 1, 2))
    # a send between the two chunks of rank 1 (a local hand-off needs none)
    sch = {r: list(a) for r, a in low.items()}
    i = sch[1].index(Action(1, Kind.FORWARD, 0))
    sch[1].insert(i + 1, Action(1, Kind.SEND_F, 0))
    assert _rejects(sch, 2, 1, "to chunk 2 on the same rank", **V) == "1SF0.0"
    # messages of one chunk pair received out of order
    sch = {r: list(a) for r, a in low.items()}
    a, b = sch[0].index(Action(3, Kind.RECV_F, 0)), sch[0].index(Action(3, Kind.RECV_F, 1))
    sch[0][a], sch[0][b] = sch[0][b], sch[0][a]
    assert _rejects(sch, 2, 1, "next message from stage 2 is 2SF0.0", **V) == "3RF1.0"
    # a compute whose remote input is never received
    sch = {r: [x for x in acts if x != Action(3, Kind.RECV_F, 1)] for r, acts in low.items()}
    assert _rejects(sch, 2, 1, r"before receiving its input \(3RF1.0\)", **V) == "3F1.0"


def test_grid_names_ranks_and_shows_memory_per_rank():
    sch = generate("zbv", 2, 2, 1, 1, 2)
    grid = format_grid(sch, held=inflight_per_rank(sch, 2, 1)).splitlines()
    assert grid[0].split() == ["step", "|", "rank", "0", "rank", "1"]
    assert grid[1].split() == ["0", "|", "0F0.0"]
    assert grid[2].split() == ["1", "|", "0F1.0", "1F0.0"]
    assert grid[-1].split()[:4] == ["peak", "|", "4", "4"]


def test_a_bound_too_small_to_move_still_yields_a_valid_schedule():
    for p, v, pl, m in itertools.product((2, 3), (2, 3), ("looped", "v"), (1, 4)):
        for split in (False, True):
            sch = greedy_schedule(p, v, pl, m, 2, 2 if m > 1 else 1, split=split, bound=1)
            validate(sch, m, 2, 2 if m > 1 else 1, chunks_per_rank=v, placement=pl)


def test_generators_check_their_chunk_counts_and_placements():
    with pytest.raises(ScheduleError, match=r"'zbv' runs \[2\] chunk\(s\) per rank, not 3.*"
                                            r"'interleaved-1f1b'"):
        generate("zbv", 2, 4, 1, 1, 3)
    with pytest.raises(ScheduleError, match=r"'1f1b' runs \[1\] chunk"):
        generate("1f1b", 2, 4, 1, 1, 2)
    assert GENERATORS["zbv"].placement == "v"
    stages = [StagePlan((i, i + 1), [f"d{r}"]) for i, r in enumerate((0, 1, 1, 0))]
    plan = Plan("t", 8, 2, 1, stages, schedule="zbv", chunks_per_rank=2, placement="v")
    assert plan.num_ranks == 2
    assert plan.devices == ["d0", "d1"]
    assert plan.rank_stages(0) == [0, 3]
    assert plan.rank_devices(1) == ["d1"]
    assert build_schedule(plan) == generate("zbv", 2, 2, 1, 1, 2)
    again = Plan.from_json(plan.to_json())
    assert (again.chunks_per_rank, again.placement, again.num_ranks) == (2, "v", 2)
    old = {k: v for k, v in plan.to_dict().items() if k not in ("chunks_per_rank", "placement")}
    old["schedule"] = "1f1b"
    with pytest.raises(PlanError, match="assigned to more than one stage"):
        Plan.from_dict(old)  # a plan without chunks: four stages, two devices each twice
    with pytest.raises(ScheduleError, match="needs the 'v' placement"):
        Plan("t", 8, 2, 1, stages, schedule="zbv", chunks_per_rank=2)
    with pytest.raises(PlanError, match=r"chunks 1 and 2 are both on rank 1"):
        Plan("t", 8, 2, 1, [StagePlan((i, i + 1), [f"d{i}"]) for i in range(4)],
             schedule="zbv", chunks_per_rank=2, placement="v")
    with pytest.raises(PlanError, match="3 stage chunks cannot be dealt"):
        Plan("t", 8, 2, 1, stages[:3], schedule="interleaved-1f1b", chunks_per_rank=2)


# ---------------------------------------------------------------------------- pricing
CHUNKED = [("interleaved-1f1b", 2), ("interleaved-1f1b", 3), ("zbv", 2), ("interleaved-1f1b", 1)]


@pytest.mark.parametrize(("schedule", "v"), CHUNKED)
@pytest.mark.parametrize("replicas", [1, 2])
def test_fast_model_equals_the_simulator_for_every_chunked_generator(schedule, v, replicas):
    """The chunk-level fast model and the simulator price the same lists alike (the latency-
    only cluster of test_pricing: devices of two speeds, overheads, all-reduce rings)."""
    import random

    from lightning_autopipe.planner.layout import BlockCosts
    from lightning_autopipe.planner.simulate import simulate
    from lightning_autopipe.planner.vcost import ChunkLayout, evaluate_chunked

    from .test_pricing import _latency_only_cluster, _profile

    rng = random.Random(f"{schedule}-{v}-{replicas}")
    pl = GENERATORS[schedule].placement
    for ranks, m, k, j in itertools.product(range(1, 4), range(1, 6), (1, 2), (1, 2)):
        if j > 1 and m < 2:
            continue
        n = ranks * v
        prof = _profile(rng, n + 3)
        costs = BlockCosts.from_profile(prof)
        cluster = _latency_only_cluster((ranks + 1) // 2 * replicas)
        groups = [[f"{'ab'[r % 2]}:{(r // 2) * replicas + i}" for i in range(replicas)]
                  for r in range(ranks)]
        cuts = [0, *sorted(rng.sample(range(1, n + 3), n - 1)), n + 3]
        owner = chunk_ranks(ranks, v, pl)
        batch = 4 * m * replicas * 3
        plan = Plan("t", batch, m, k, [StagePlan((cuts[c], cuts[c + 1]), groups[owner[c]])
                                       for c in range(n)],
                    schedule=schedule, drain_slices=j, chunks_per_rank=v, placement=pl)
        sim = simulate(plan, prof, cluster)
        est = evaluate_chunked(costs, ChunkLayout.from_cluster(cluster, groups, v, pl), cuts,
                               plan.step_shape())
        case = (schedule, v, ranks, replicas, m, k, j)
        assert est.iteration_ms == pytest.approx(sim.iteration_ms, rel=1e-9), case
        assert est.stage_ms == pytest.approx(sim.stage_ms, rel=1e-9), case
        for r in range(ranks):
            assert est.peak_bytes[r] == pytest.approx(
                sim.peak_memory_bytes[groups[r][0]], abs=1.0), case


def test_hand_computed_v_timeline_in_the_simulator():
    """ZB-V on 2 ranks (rank 0: chunks 0 and 3, rank 1: chunks 1 and 2), m = 2, free links;
    every chunk F 1, B 1, W 1, except chunk 0 whose whole backward (2) is its W (it has no
    input gradient). By hand, from the lists of test_hand_computed_small_v:
    rank 1: 1F0 [1,2] 2F0 [2,3] 1F1 [3,4] 2F1 [4,5] 2B0 [5,6] 1B0 [6,7] 2B1 [7,8] 1B1 [8,9]
    then 1W0 2W0 1W1 2W1 to 13; rank 0: 0F0 [0,1] 0F1 [1,2] 3F0 [3,4] 3B0 [4,5] 3F1 [5,6]
    3B1 [6,7] 0B0 at 7 (empty) 0W0 [7,9] 0B1 at 9 3W0 [9,10] 0W1 [10,12] 3W1 [12,13]."""
    from lightning_autopipe.planner.simulate import simulate

    from .test_zero_bubble import _free, _profile

    prof = _profile([(1.0, 2.0, 1.0, 1.0)] * 4)
    stages = [StagePlan((c, c + 1), [f"s:{r}"]) for c, r in enumerate((0, 1, 1, 0))]
    plan = Plan("t", 8, 2, 1, stages, schedule="zbv", chunks_per_rank=2, placement="v")
    res = simulate(plan, prof, _free(2))
    assert res.iteration_ms == pytest.approx(13.0)
    got = {(e.device, e.label): (e.start_ms, e.end_ms) for e in res.events
           if e.kind in ("F", "B", "W")}
    want = {
        ("s:1", "1F0.0"): (1, 2), ("s:1", "2F0.0"): (2, 3), ("s:1", "1F1.0"): (3, 4),
        ("s:1", "2F1.0"): (4, 5), ("s:1", "2B0.0"): (5, 6), ("s:1", "1B0.0"): (6, 7),
        ("s:1", "2B1.0"): (7, 8), ("s:1", "1B1.0"): (8, 9), ("s:1", "1W0.0"): (9, 10),
        ("s:1", "2W0.0"): (10, 11), ("s:1", "1W1.0"): (11, 12), ("s:1", "2W1.0"): (12, 13),
        ("s:0", "0F0.0"): (0, 1), ("s:0", "0F1.0"): (1, 2), ("s:0", "3F0.0"): (3, 4),
        ("s:0", "3B0.0"): (4, 5), ("s:0", "3F1.0"): (5, 6), ("s:0", "3B1.0"): (6, 7),
        ("s:0", "0B0.0"): (7, 7), ("s:0", "0W0.0"): (7, 9), ("s:0", "0B1.0"): (9, 9),
        ("s:0", "3W0.0"): (9, 10), ("s:0", "0W1.0"): (10, 12), ("s:0", "3W1.0"): (12, 13),
    }
    assert sorted(got) == sorted(want)
    for key, span in want.items():
        assert got[key] == pytest.approx(span), key
    # no message crosses the V's turn on rank 1 (chunks 1 -> 2) or leaves the model's ends
    sends = {e.label for e in res.events if e.kind in ("SF", "SB")}
    assert sends == {"0SF0.0", "0SF1.0", "2SF0.0", "2SF1.0", "3SB0.0", "3SB1.0",
                     "1SB0.0", "1SB1.0"}
    # memory: each rank holds the state of its two chunks' parameters (1000 bytes each) and
    # at its peak both units on both chunks (4 chunk micro-batches of 1000 bytes)
    from lightning_autopipe.planner.pricing import param_state_factor

    for dev in ("s:0", "s:1"):
        assert res.peak_memory_bytes[dev] == 2 * 1000 * param_state_factor(2.0) + 4 * 1000
