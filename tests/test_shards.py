"""Tensor-parallel splits put together and written back, on simulated ranks (the
collectives replaced by their single-process meaning; the engine runs are in
test_tp.py)."""

from __future__ import annotations

import torch

from vllm_nnsight_plugin.engine import shards
from vllm_nnsight_plugin.engine.shards import Split


class Group:
    """A rank of a simulated tensor-parallel group (``shards.Collectives``)."""

    def __init__(self, ranks, rank, all_gather=None, all_reduce=None, split_of=None):  # noqa: ANN001
        self.ranks, self.rank = ranks, rank
        self.all_gather, self.all_reduce, self.split_of = all_gather, all_reduce, split_of


def _ranks_of(whole: torch.Tensor, sizes: tuple[int, ...], ranks: int,
              replicas: tuple[int, ...] | None = None) -> list[torch.Tensor]:
    """Each rank's local value of ``whole``: its slice of every segment."""
    out = []
    for rank in range(ranks):
        parts, full = [], 0
        for i, size in enumerate(sizes):
            step = replicas[i] if replicas else 1
            slot = rank // step
            parts.append(whole[..., full + slot * size : full + (slot + 1) * size])
            full += (ranks // step) * size
        out.append(torch.cat(parts, dim=-1))
    return out


def test_a_sharded_value_is_served_whole_and_edits_land_in_each_ranks_part():
    ranks, sizes = 2, (3, 2)
    whole = torch.arange(2 * 10, dtype=torch.float32).reshape(2, 10)
    local = _ranks_of(whole, sizes, ranks)
    gather = lambda x: torch.cat([t.clone() for t in local], dim=-1)  # noqa: E731
    for rank in range(ranks):
        x = local[rank].clone()
        served, write_back = shards.gather((x, None), Split.sharded(sizes), Group(ranks, rank, gather))
        assert served[1] is None
        torch.testing.assert_close(served[0], whole)
        served[0].mul_(-1)
        write_back()
        torch.testing.assert_close(x, -local[rank])


def test_replicated_kv_heads_are_gathered_once_per_group():
    ranks, sizes, replicas = 4, (2, 1, 1), (1, 2, 2)
    whole = torch.arange(3 * 12, dtype=torch.float32).reshape(3, 12)  # q: 4*2, k: 2*1, v: 2*1
    local = _ranks_of(whole, sizes, ranks, replicas)
    split = Split.sharded(sizes, replicas)
    for rank in range(ranks):
        x = local[rank].clone()
        served, write_back = shards.gather(x, split, Group(ranks, rank, lambda x: torch.cat(local, dim=-1)))
        torch.testing.assert_close(served, whole)
        served.add_(1)
        write_back()
        torch.testing.assert_close(x, local[rank] + 1)


def test_a_partial_sum_is_summed_and_an_edit_lands_on_rank_zero_only():
    parts = [torch.ones(2, 4), 2 * torch.ones(2, 4)]
    for rank in range(2):
        x = parts[rank].clone()
        group = Group(2, rank, all_reduce=lambda x: sum(p.clone() for p in parts))
        served, write_back = shards.gather(x, Split.partial(), group)
        torch.testing.assert_close(served, 3 * torch.ones(2, 4))
        served.add_(10)
        write_back()
        torch.testing.assert_close(x, parts[rank] + (10 if rank == 0 else 0))


def test_a_split_that_cannot_be_put_together_is_refused_with_its_reason():
    model = torch.nn.Sequential(torch.nn.Linear(2, 2))

    def shard_of(module, io):  # noqa: ANN001, ANN202
        if isinstance(module, torch.nn.Linear):
            raise NotImplementedError("no way")
        return None

    splits = shards.Splits(model, Group(2, 0, split_of=shard_of))
    assert splits.of((id(model), "output")) is None
    found = splits.of((id(model[0]), "output"))
    assert found == Split("refused", reason="no way") and found.reason == "no way"
    assert splits.of((id(model[0]), "output")) is found  # (looked up once)
