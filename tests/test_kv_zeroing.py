"""How a worker zeroes the KV blocks traced requests freed (``boundary/kv_zeroing.py``):
the layer-by-layer way on real tensor layouts, and which way a runner gets. The engine
side (a NaN-edited request's blocks zeroed before reuse) is test_reliability.py's; on
CUDA test_engine_isolation.py checks that vLLM's zeroer was chosen and built at load."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    SlidingWindowSpec,
    UniformTypeKVCacheSpecs,
)

from vllm_nnsight_plugin.boundary import kv_zeroing

N = 7  # blocks in the pool
ZEROED = [2, 5]


def _layouts() -> dict[str, list[torch.Tensor]]:
    cross = torch.randn(N, 3, 2, 4, 2, 32)  # (blocks, layers, k/v, block size, heads, head size)
    return {
        "kv first": [torch.randn(2, N, 4, 2, 32) for _ in range(3)],
        "blocks first": [torch.randn(N, 2, 4, 2, 32) for _ in range(3)],
        "views of one cross-layer tensor": [cross[:, layer] for layer in range(3)],
        "k and v apart": [(torch.randn(N, 4, 2, 32), torch.randn(N, 4, 2, 32)) for _ in range(3)],
    }


@pytest.mark.parametrize("layout", list(_layouts()))
def test_layer_by_layer_zeroes_exactly_the_named_blocks_of_every_layer(layout):
    caches = _layouts()[layout]
    tensors = list(kv_zeroing._tensors(caches))
    before = [t.clone() for t in tensors]
    kv_zeroing.zero_layers(caches, N, ZEROED)
    for tensor, old in zip(tensors, before):
        dim = kv_zeroing._blocks_dim(tensor, N)
        for block in range(N):
            got, was = tensor.select(dim, block), old.select(dim, block)
            if block in ZEROED:
                assert torch.count_nonzero(got) == 0, (layout, block)
            else:
                assert torch.equal(got, was), (layout, block)  # (a neighbour untouched)


def _runner(groups=(), kv_caches=(), device="cuda", **extra):
    config = KVCacheConfig(num_blocks=N, kv_cache_tensors=[], kv_cache_groups=list(groups))
    return SimpleNamespace(device=torch.device(device), kv_cache_config=config, kv_caches=list(kv_caches),
                           _init_kv_zero_meta=lambda: None, **extra)


def _group(spec) -> KVCacheGroupSpec:
    return KVCacheGroupSpec(layer_names=["model.layers.0.self_attn.attn"], kv_cache_spec=spec)


FULL = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=32, dtype=torch.float16)
SLIDING = SlidingWindowSpec(block_size=16, num_kv_heads=2, head_size=32, dtype=torch.float16, sliding_window=64)


def test_vllms_zeroer_is_taken_only_where_it_covers_every_layer():
    assert kv_zeroing._zeroer_covers_every_layer(_runner([_group(FULL)]))
    uniform = UniformTypeKVCacheSpecs(block_size=16, kv_cache_specs={"a": FULL, "b": FULL})
    assert kv_zeroing._zeroer_covers_every_layer(_runner([_group(uniform)]))
    # it skips sliding-window layers, a cross-layer layout would overrun, and it is CUDA's
    assert not kv_zeroing._zeroer_covers_every_layer(_runner([_group(FULL), _group(SLIDING)]))
    mixed = UniformTypeKVCacheSpecs(block_size=16, kv_cache_specs={"a": FULL, "b": SLIDING})
    assert not kv_zeroing._zeroer_covers_every_layer(_runner([_group(mixed)]))
    assert not kv_zeroing._zeroer_covers_every_layer(_runner([_group(FULL)], cross_layers_kv_cache=torch.zeros(1)))
    assert not kv_zeroing._zeroer_covers_every_layer(_runner([_group(FULL)], device="cpu"))
    assert not kv_zeroing._zeroer_covers_every_layer(_runner([]))


def test_where_vllms_zeroer_does_not_fit_blocks_are_zeroed_layer_by_layer_and_a_gap_is_named(caplog):
    sliding = _runner([_group(FULL), _group(SLIDING)], kv_caches=_layouts()["kv first"])
    assert kv_zeroing.prepare(sliding) == "layers"
    kv_zeroing.zero(sliding, ZEROED)
    assert all(torch.count_nonzero(t.select(1, 2)) == 0 for t in sliding.kv_caches)
    # a tensor with no dimension of the pool's size cannot be zeroed: said at load
    odd = _runner([_group(SLIDING)], kv_caches=[torch.zeros(2, N + 1, 4)])
    with caplog.at_level("ERROR", logger="vllm.nnsight_plugin"):
        assert kv_zeroing.prepare(odd) == "none"
    assert "not zeroed before reuse" in caplog.text
    assert kv_zeroing.prepare(_runner([], kv_caches=[])) == "layers"  # no KV cache: nothing to zero


class _Zeroer:
    def __init__(self, meta=True):
        self._meta = (1,) if meta else None
        self.calls: list[list[int]] = []

    def zero_block_ids(self, ids):
        self.calls.append(list(ids))


def test_the_zeroer_is_built_privately_and_compiled_for_each_block_count_it_specialises_on():
    runner = _runner([_group(FULL)], kv_caches=_layouts()["kv first"])
    runner.kv_block_zeroer = None  # (what Model Runner V2 holds until vLLM needs one)

    def build():
        runner.kv_block_zeroer = _Zeroer()

    runner._init_kv_zero_meta = build
    assert kv_zeroing.prepare(runner) == "vllm"
    assert runner.kv_block_zeroer is None  # vLLM's attribute as it was: vLLM never calls ours
    zeroer = runner.__dict__[kv_zeroing.METHOD][1]
    assert zeroer.calls == [[0], [0, 0], [0] * 16]  # block 0 only: vLLM's null block
    kv_zeroing.zero(runner, ZEROED)
    assert zeroer.calls[-1] == ZEROED


@pytest.mark.parametrize("failure", ["raises", "covers nothing"])
def test_a_zeroer_that_does_not_build_leaves_the_runner_as_it_was_and_zeroes_layer_by_layer(failure):
    runner = _runner([_group(FULL)], kv_caches=_layouts()["blocks first"])

    def build():
        runner._kv_block_zeroer = _Zeroer(meta=False)  # (V1's attribute)
        if failure == "raises":
            raise AssertionError("Non-uniform page sizes: 8192 vs 4096")

    runner._init_kv_zero_meta = build
    assert kv_zeroing.prepare(runner) == "layers"
    assert not hasattr(runner, "_kv_block_zeroer")
