"""How a worker zeroes the KV blocks a traced request freed (:mod:`.kv_blocks` says why).

One way on every runner and device: an ``index_fill_`` with 0 per attention layer's
KV tensor, along its blocks dimension, over the kernel blocks of each freed block.
What each layer needs is found once, when the runner allocates its KV cache, from
vLLM's own account of it (the attention groups, each backend's blocks dimension, the
kernel block size): every attention layer, sliding-window and cross-attention ones
too, packed layouts included (each layer's tensor is a view that skips the other
layers' bytes). Mamba layers are left alone: a request's state there starts fresh.
Where a layer's blocks dimension does not hold exactly the pool's blocks in the kernel
blocks vLLM's block tables address, nothing is zeroed, that is logged as an error (with
the layer and its shape) when the cache is allocated, and blocks that may change
activations are refused (:func:`refusal`); reads still run. Nothing is
compiled, and a step with blocks to zero takes one upload of their ids (pinned, not
waited on) and one fill per layer.
"""

from __future__ import annotations

import logging
from typing import Any, NamedTuple

logger = logging.getLogger("vllm.nnsight_plugin")

STATS = {"kv_zero_passes": 0, "kv_zeroed_blocks": 0}  # since start (the lane-stats RPC)
LAYERS = "_nnsight_kv_layers"  # on the runner: the layers to zero (None: not known, nothing zeroed)
WHY = "_nnsight_kv_not_zeroed"  # on the runner: why not (set with LAYERS None)


class Layer(NamedTuple):
    tensor: Any  # the layer's KV cache (a view)
    dim: int  # its blocks dimension
    ratio: int  # kernel blocks per block of vLLM's pool (block b: kernel blocks b*ratio ... b*ratio+ratio-1)


def prepare(runner: Any) -> None:
    """After the runner allocated its KV cache: find each attention layer's tensor."""
    try:
        runner.__dict__[LAYERS] = find_layers(runner)
    except Exception as exc:  # noqa: BLE001 - a layout this code does not know
        runner.__dict__[LAYERS], runner.__dict__[WHY] = None, f"{type(exc).__name__}: {exc}"
        logger.error("blocks that traced requests edited cannot be zeroed before reuse (%s); blocks that may "
                     "change activations are refused on this engine", runner.__dict__[WHY])


def forget(runner: Any) -> None:
    runner.__dict__.pop(LAYERS, None)
    runner.__dict__.pop(WHY, None)


def refusal(runner: Any) -> str | None:
    """Why this worker must refuse blocks that may change activations (an edit's NaN
    would stay in blocks the next owner reads); None where freed blocks are zeroed."""
    if LAYERS not in runner.__dict__:
        why = "the plugin did not see this worker's KV cache allocated"
    elif runner.__dict__[LAYERS] is None:
        why = runner.__dict__.get(WHY, "its layout is not known")
    else:
        return None
    return (f"this engine cannot zero the KV-cache blocks a traced request leaves ({why}), so blocks that may "
            "change activations (edits, and code) are refused here; reads run")


def layers_of(runner: Any) -> list[Layer] | None:
    return runner.__dict__.get(LAYERS)


def zero(runner: Any, block_ids: list[int]) -> None:
    zero_layers(layers_of(runner) or [], block_ids)
    STATS["kv_zero_passes"] += 1
    STATS["kv_zeroed_blocks"] += len(block_ids)


def zero_layers(layers: list[Layer], block_ids: list[int]) -> None:
    import torch

    indexes: dict[tuple[int, Any], Any] = {}
    for layer in layers:
        key = (layer.ratio, layer.tensor.device)
        index = indexes.get(key)
        if index is None:
            ids = torch.tensor(block_ids, dtype=torch.int64)
            if layer.ratio > 1:
                ids = (ids[:, None] * layer.ratio + torch.arange(layer.ratio)).flatten()
            if layer.tensor.device.type == "cuda":  # (pinned and not waited on: the CPU runs ahead)
                ids = ids.pin_memory()
            index = indexes[key] = ids.to(layer.tensor.device, non_blocking=True)
        layer.tensor.index_fill_(layer.dim, index, 0)


def find_layers(runner: Any) -> list[Layer]:
    """Each attention layer's KV tensor, blocks dimension and kernel blocks per block.
    Raises ValueError where a tensor's blocks dimension does not hold exactly the pool's
    blocks times the kernel blocks per block that vLLM's block tables address (zeroing
    along a dimension taken wrongly would zero other requests' values)."""
    import torch
    from vllm.v1.kv_cache_interface import AttentionSpec

    groups, kernel_block_sizes = _attention_groups(runner)
    context = runner.compilation_config.static_forward_context
    num_blocks = runner.kv_cache_config.num_blocks
    runner_only = getattr(runner, "runner_only_attn_layers", None) or set()
    cache_dtype = runner.cache_config.cache_dtype
    layers: list[Layer] = []
    seen: set[tuple] = set()
    for group in groups:
        spec = group.kv_cache_spec
        if not isinstance(spec, AttentionSpec) or group.kv_cache_group_id >= len(kernel_block_sizes):
            continue
        # (as vLLM 0.26's V2 runner lays a group out: a spec that compresses its tokens,
        # DeepSeek V4's, stores a block in one kernel block of its storage size; were the V1
        # runner to size such a group otherwise, the check below refuses it: nothing zeroed wrongly)
        stored = getattr(spec, "storage_block_size", spec.block_size)
        kernel_block_size = stored if stored != spec.block_size else kernel_block_sizes[group.kv_cache_group_id]
        per_block = stored // kernel_block_size  # (as vLLM maps a block table to kernel blocks)
        for name in group.layer_names:
            kv = getattr(context.get(name), "kv_cache", None)
            if name in runner_only or not isinstance(kv, torch.Tensor) or kv.device.type != runner.device.type:
                continue  # (a host-resident cache holds other blocks than the pool's)
            if getattr(group, "kernel_block_stride", 0):  # (vLLM 0.32's packed layout: a view by pool blocks)
                kv, dim, ratio = group.map_kv_cache_to_manager_blocks(kv, num_blocks), 0, 1
            elif hasattr(group.backend, "get_kv_cache_block_dim"):  # (vLLM 0.26: the backend's layout)
                dim, ratio = group.backend.get_kv_cache_block_dim(
                    kernel_block_size, spec.num_kv_heads, spec.head_size, cache_dtype_str=cache_dtype), per_block
            else:  # (vLLM 0.32: blocks first)
                dim, ratio = 0, per_block
            if stored % kernel_block_size or kv.shape[dim] != num_blocks * ratio:
                raise ValueError(f"{name}: shape {tuple(kv.shape)}, blocks dimension {dim}, does not hold "
                                 f"{num_blocks} blocks of {stored} slots in kernel blocks of {kernel_block_size}")
            key = (kv.data_ptr(), dim, tuple(kv.shape), kv.stride())
            if key not in seen:  # (layers that share a KV cache)
                seen.add(key)
                layers.append(Layer(kv, dim, ratio))
    return layers


def _attention_groups(runner: Any) -> tuple[list[Any], list[int]]:
    if hasattr(runner, "_kv_cache_spec_attn_group_iterator"):  # V1 runner (and the CPU runner)
        return list(runner._kv_cache_spec_attn_group_iterator()), list(runner._kernel_block_sizes)
    return [g for groups in runner.attn_groups for g in groups], list(runner.kernel_block_sizes)  # V2
