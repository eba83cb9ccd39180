"""How a worker zeroes the KV blocks traced requests freed (``boundary/kv_zeroing.py``):
the fills on real tensor layouts (a layer's blocks in any dimension, several kernel
blocks per pool block, views into a packed cache), each checked against indexing
written out here. In the engine: test_engine_isolation.py checks the layers found on
the running model, test_reliability.py that a NaN-edited request's blocks reach no one."""

from __future__ import annotations

import pytest
import torch

from vllm_nnsight_plugin.boundary.kv_zeroing import Layer, zero_layers

N = 7  # blocks in vLLM's pool
FREED = [2, 5]


def _block(tensor: torch.Tensor, dim: int, ratio: int, block: int) -> torch.Tensor:
    """Pool block ``block`` of a layer: its kernel blocks, written out by hand."""
    return tensor.narrow(dim, block * ratio, ratio)


def _cases() -> dict[str, list[Layer]]:
    packed = torch.randn(N, 3, 2, 4, 2, 32)  # (blocks, layers, k/v, block size, heads, head size)
    return {
        "blocks second": [Layer(torch.randn(2, N, 4, 2, 32), 1, 1) for _ in range(3)],
        "blocks first (vLLM 0.32, the CPU)": [Layer(torch.randn(N, 2, 4, 2, 32), 0, 1) for _ in range(3)],
        "MLA (blocks, slots, dim)": [Layer(torch.randn(N, 16, 96), 0, 1) for _ in range(3)],
        "views of a packed cache": [Layer(packed[:, layer], 0, 1) for layer in range(3)],
        "4 kernel blocks per pool block": [Layer(torch.randn(2, 4 * N, 4, 2, 32), 1, 4) for _ in range(3)],
        "ratios that differ by layer": [Layer(torch.randn(2 * N, 8, 32), 0, 2), Layer(torch.randn(2, N, 16, 32), 1, 1)],
    }


@pytest.mark.parametrize("case", list(_cases()))
def test_every_layer_loses_exactly_the_freed_blocks(case):
    layers = _cases()[case]
    before = [layer.tensor.clone() for layer in layers]
    zero_layers(layers, FREED)
    for layer, old in zip(layers, before):
        for block in range(N):
            got = _block(layer.tensor, layer.dim, layer.ratio, block)
            if block in FREED:
                assert torch.count_nonzero(got) == 0, (case, block)
            else:  # (its neighbours, and the other layers' bytes of a packed block, untouched)
                assert torch.equal(got, _block(old, layer.dim, layer.ratio, block)), (case, block)


def test_a_packed_caches_other_bytes_stay():
    # a packed cache: one allocation, each block holding every layer's page side by side;
    # only two of its three layers are attention layers (the third, say, a Mamba state)
    packed = torch.randn(N, 3, 64)
    keep = packed[:, 2].clone()
    zero_layers([Layer(packed[:, 0], 0, 1), Layer(packed[:, 1], 0, 1)], FREED)
    assert torch.count_nonzero(packed[FREED, :2]) == 0
    assert torch.equal(packed[:, 2], keep)


@pytest.mark.parametrize("spelled", ["keyword", "positional"])
def test_no_view_of_vllms_throwaway_profiling_cache_is_held(spelled):
    # vLLM allocates a small KV cache to profile CUDA graphs' memory and frees it by
    # dropping its references: a view kept here would keep its memory in use
    from types import SimpleNamespace

    from vllm_nnsight_plugin.boundary import kv_blocks, kv_zeroing

    allocate = kv_blocks._allocating(lambda self, *args, **kwargs: None)
    runner = SimpleNamespace()
    runner.__dict__[kv_zeroing.LAYERS] = [Layer(torch.zeros(N, 4), 0, 1)]  # (an earlier cache's)
    if spelled == "keyword":
        allocate(runner, "config", is_profiling=True)
    else:
        allocate(runner, "config", True)
    assert kv_zeroing.layers_of(runner) is None
