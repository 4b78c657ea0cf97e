"""Uneven replica batches: each replica's share of the joined batches, on real gloo ranks."""

from __future__ import annotations

import torch
import torch.distributed as dist

from lightning_autopipe.errors import InputError
from lightning_autopipe.runtime.replica_share import take_share


def _shares(rank: int, world: int) -> dict:
    """Each rank loads 6 samples of its own (ids, a per-batch constant, labels, their names as
    a collate function lists strings, a name of the batch): replica 0 takes 8 and replica 1 4
    of the 12 joined ones; then a short batch of 3 each, then unequal batches (6 and 4 samples:
    a data set sharded by hand), then batches of unlike sequence length."""
    ids = torch.arange(6 * 3).reshape(6, 3) + 100 * rank
    names = [f"s{int(i)}" for i in ids[:, 0]]
    batch = {"ids": ids, "weights": torch.tensor([0.5, 2.0]), "labels": ids[:, 0].clone(),
             "names": names, "name": f"rank{rank}"}
    group = dist.new_group([0, 1])
    got, per = take_share(batch, 6, [8, 4], rank, [0, 1], group)
    out = {"ids": got["ids"], "labels": got["labels"], "weights": got["weights"],
           "names": got["names"], "name": got["name"], "per": per}
    # an epoch's short last batch (3 each): the 6 joined samples in the plan's proportions
    out["short"] = take_share((ids[:3],), 3, [8, 4], rank, [0, 1], group)
    unequal = 6 if rank == 0 else 4
    out["unequal"] = take_share([ids[:unequal], names[:unequal]], unequal, [8, 4], rank,
                                [0, 1], group)
    ragged = torch.zeros(6, 3 + rank, dtype=torch.long)  # padded per batch: unlike lengths
    try:
        take_share((ragged, ragged[:, 0]), 6, [8, 4], rank, [0, 1], group)
    except InputError as exc:
        out["error"] = str(exc)
    dist.destroy_process_group(group)
    return out


def test_each_replica_trains_its_share_of_the_joined_batches_and_unlike_shapes_stop_both(gloo):
    ranks = gloo(2).run(_shares)
    joined = torch.cat([torch.arange(18).reshape(6, 3), torch.arange(18).reshape(6, 3) + 100])
    short = torch.cat([torch.arange(9).reshape(3, 3), torch.arange(9).reshape(3, 3) + 100])
    unequal = torch.cat([torch.arange(18).reshape(6, 3), torch.arange(12).reshape(4, 3) + 100])
    for rank, (lo, hi), (s_lo, s_hi) in zip(range(2), [(0, 8), (8, 12)], [(0, 4), (4, 6)]):
        got = ranks[rank]
        assert torch.equal(got["ids"], joined[lo:hi])
        assert torch.equal(got["labels"], joined[lo:hi, 0])  # the same samples, in order
        assert got["names"] == [f"s{int(i)}" for i in joined[lo:hi, 0]]  # names go with them
        assert torch.equal(got["weights"], torch.tensor([0.5, 2.0]))  # not per sample: kept
        assert got["name"] == f"rank{rank}"
        assert got["per"] == 6.0  # the even share units are weighted over
        assert torch.equal(got["short"][0][0], short[s_lo:s_hi])
        assert got["short"][1] == 3.0
        # 10 joined samples dealt 8:4 -> 7 and 3, weighted over 5 each
        (u_ids, u_names), u_per = got["unequal"]
        u_lo, u_hi = [(0, 7), (7, 10)][rank]
        assert torch.equal(u_ids, unequal[u_lo:u_hi])
        assert u_names == [f"s{int(i)}" for i in unequal[u_lo:u_hi, 0]]
        assert u_per == 5.0
        assert "differ in kind or in a tensor's shape" in got["error"]
        assert "balance_replicas=False" in got["error"]
