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


def _runner(kv: torch.Tensor, block_size: int, kernel_block_size: int, backend: type = object,
            compressed: bool = False):
    """A V2-shaped runner holding one attention layer's KV tensor, with vLLM's own
    attention group and spec (what find_layers reads of a runner, no more)."""
    from types import SimpleNamespace

    from vllm.v1.kv_cache_interface import FullAttentionSpec
    from vllm.v1.worker.utils import AttentionGroup

    class Compressed(FullAttentionSpec):
        """vLLM 0.26's spec of a cache storing its block's tokens in fewer slots (DeepSeek V4)."""

        @property
        def storage_block_size(self) -> int:
            return self.block_size // 4

    spec = (Compressed if compressed else FullAttentionSpec)(block_size=block_size, num_kv_heads=2, head_size=32,
                                                             dtype=kv.dtype)
    group = AttentionGroup(backend=backend, layer_names=["layers.0.attn"], kv_cache_spec=spec,
                           kv_cache_group_id=0)
    return SimpleNamespace(
        attn_groups=[[group]], kernel_block_sizes=[kernel_block_size], device=kv.device,
        compilation_config=SimpleNamespace(static_forward_context={"layers.0.attn": SimpleNamespace(kv_cache=kv)}),
        kv_cache_config=SimpleNamespace(num_blocks=N), cache_config=SimpleNamespace(cache_dtype="auto"))


class _BlocksSecond:
    """A backend that says where its blocks are (as vLLM 0.26's do)."""

    @staticmethod
    def get_kv_cache_block_dim(block_size, num_kv_heads, head_size, cache_dtype_str="auto"):
        return 1


@pytest.mark.parametrize(("shape", "block_size", "kernel", "backend", "compressed", "found"), [
    ((N, 2, 16, 2, 32), 16, 16, object, False, (0, 1)),
    ((2 * N, 2, 16, 2, 32), 32, 16, object, False, (0, 2)),  # (two kernel blocks per pool block)
    ((2, N, 16, 2, 32), 16, 16, _BlocksSecond, False, (1, 1)),
    ((N, 16, 96), 64, 16, object, True, (0, 1)),  # (one kernel block of its storage size per block)
])
def test_layers_are_found_where_vllms_block_tables_address_them(shape, block_size, kernel, backend, compressed,
                                                                 found):
    from vllm_nnsight_plugin.boundary.kv_zeroing import find_layers

    kv = torch.randn(shape)
    [layer] = find_layers(_runner(kv, block_size, kernel, backend, compressed))
    assert layer.tensor is kv and (layer.dim, layer.ratio) == found


@pytest.mark.parametrize(("shape", "block_size", "kernel", "backend"), [
    # twice the pool's blocks along dimension 0 where the block tables address pool blocks
    # whole: dividing alone would take two "kernel blocks" per block and zero the wrong rows
    ((2 * N, 2, 16, 2, 32), 16, 16, object),
    ((N, 2, 16, 2, 32), 16, 16, _BlocksSecond),  # (the backend's blocks dimension holds 2)
    ((N, 2, 16, 2, 32), 32, 16, object),  # (two kernel blocks per pool block expected, one there)
])
def test_a_layout_not_matching_the_block_tables_zeroes_nothing_and_says_why(shape, block_size, kernel, backend,
                                                                            caplog):
    from vllm_nnsight_plugin.boundary import kv_zeroing

    runner = _runner(torch.randn(shape), block_size, kernel, backend)
    with pytest.raises(ValueError, match="layers.0.attn: shape"):
        kv_zeroing.find_layers(runner)
    with caplog.at_level("ERROR", logger="vllm.nnsight_plugin"):
        kv_zeroing.prepare(runner)
    assert kv_zeroing.layers_of(runner) is None
    assert "cannot be zeroed before reuse (ValueError: layers.0.attn: shape" in caplog.text


def test_a_worker_that_zeroes_nothing_refuses_edits_and_says_why():
    from types import SimpleNamespace

    from vllm_nnsight_plugin.boundary import kv_zeroing

    runner = SimpleNamespace()
    assert "did not see this worker's KV cache allocated" in kv_zeroing.refusal(runner)
    runner.__dict__.update({kv_zeroing.LAYERS: None, kv_zeroing.WHY: "ValueError: layers.0.attn: shape (3,)"})
    assert "(ValueError: layers.0.attn: shape (3,)), so blocks that may change activations" in \
        kv_zeroing.refusal(runner)
    runner.__dict__[kv_zeroing.LAYERS] = []  # (no attention layer: nothing to zero)
    assert kv_zeroing.refusal(runner) is None
