"""How a worker zeroes the KV blocks a traced request freed (:mod:`.kv_blocks` says why),
chosen once before warm-up, so no step builds or compiles anything to do it:

- ``vllm``: a private instance of vLLM's KV-block zeroer (one Triton kernel over every
  layer), where it covers every layer: only full-attention KV groups (it skips
  sliding-window, chunked-local, cross-attention and Mamba layers) and no cross-layer
  KV layout (its per-layer segments would overrun into the next block). Its kernel is
  compiled for every block count it specialises on, on block 0 (vLLM's null block,
  never a token's). Private: vLLM's own zeroer (Mamba models) rotates its pinned id
  buffers once per step, and a second caller would overwrite one still being copied.
- ``layers``: one ``index_fill_`` per KV tensor along its blocks dimension (views of a
  cross-layer tensor included); where the zeroer does not cover every layer.
- ``cpu``: the CPU runner's own ``_zero_block_ids``.
- ``none``: a KV tensor with no dimension of the pool's size; logged at load, because
  an edit's NaN in a freed block could then reach the next owner.
"""

from __future__ import annotations

import logging
from typing import Any

logger = logging.getLogger("vllm.nnsight_plugin")

METHOD = "_nnsight_kv_zeroing"  # on the runner: (method name, the zeroer or None)
_VLLM_ATTRS = ("kv_block_zeroer", "_kv_block_zeroer")  # V2, V1: where _init_kv_zero_meta puts it
_WARM_COUNTS = (1, 2, 16)  # Triton specialises an int argument on 1 and on multiples of 16


def prepare(runner: Any) -> str:
    """Pick (and for ``vllm`` build and compile) this runner's way; before warm-up."""
    zeroer = _private_vllm_zeroer(runner) if _zeroer_covers_every_layer(runner) else None
    if zeroer is not None:
        for count in _WARM_COUNTS:
            zeroer.zero_block_ids([0] * count)
        runner.__dict__[METHOD] = ("vllm", zeroer)
    else:
        runner.__dict__[METHOD] = (_fallback(runner), None)
    if runner.__dict__[METHOD][0] == "none":
        logger.error("the KV cache has a tensor with no dimension of %s blocks: blocks that traced requests "
                     "edited are not zeroed before reuse", _num_blocks(runner))
    return runner.__dict__[METHOD][0]


def method_of(runner: Any) -> str:
    """The way chosen before warm-up; where no warm-up chose one (the CPU worker's own),
    the fallback, which builds nothing."""
    chosen = runner.__dict__.get(METHOD)
    if chosen is None:
        chosen = runner.__dict__[METHOD] = (_fallback(runner), None)
    return chosen[0]


def zero(runner: Any, block_ids: list[int]) -> None:
    method_of(runner)
    method, zeroer = runner.__dict__[METHOD]
    if method == "vllm":
        zeroer.zero_block_ids(list(block_ids))
    elif method == "cpu":
        runner._zero_block_ids(list(block_ids))
    elif method == "layers":
        zero_layers(runner.kv_caches, _num_blocks(runner), block_ids)


def zero_layers(kv_caches: list[Any], num_blocks: int, block_ids: list[int]) -> None:
    """``index_fill_`` with 0 along each KV tensor's dimension of ``num_blocks``."""
    import torch

    index = None
    for tensor in _tensors(kv_caches):
        dim = _blocks_dim(tensor, num_blocks)
        if dim is None:
            continue
        if index is None or index.device != tensor.device:
            index = torch.tensor(block_ids, device=tensor.device)
        tensor.index_fill_(dim, index, 0)


def _fallback(runner: Any) -> str:
    if type(runner).__name__ == "CPUModelRunner" and hasattr(runner, "_zero_block_ids"):
        return "cpu"
    num_blocks = _num_blocks(runner)
    tensors = list(_tensors(getattr(runner, "kv_caches", None) or []))
    if all(_blocks_dim(t, num_blocks) is not None for t in tensors):  # (no KV cache: nothing to zero)
        return "layers"
    return "none"


def _zeroer_covers_every_layer(runner: Any) -> bool:
    if getattr(getattr(runner, "device", None), "type", "cpu") != "cuda" \
            or not hasattr(runner, "_init_kv_zero_meta") \
            or getattr(runner, "cross_layers_kv_cache", None) is not None:
        return False
    from vllm.v1.kv_cache_interface import FullAttentionSpec, UniformTypeKVCacheSpecs

    def full(spec: Any) -> bool:
        if isinstance(spec, UniformTypeKVCacheSpecs):
            return all(full(s) for s in spec.kv_cache_specs.values())
        return isinstance(spec, FullAttentionSpec)

    groups = getattr(getattr(runner, "kv_cache_config", None), "kv_cache_groups", None) or []
    return bool(groups) and all(full(g.kv_cache_spec) for g in groups)


def _private_vllm_zeroer(runner: Any) -> Any:
    """vLLM's ``_init_kv_zero_meta`` builds onto the runner; take the zeroer and put back
    what the runner held. None where it fails (e.g. unequal page sizes) or covers nothing."""
    saved = {name: runner.__dict__[name] for name in _VLLM_ATTRS if name in runner.__dict__}
    built = None
    try:
        runner._init_kv_zero_meta()
        built = next((runner.__dict__[n] for n in _VLLM_ATTRS if runner.__dict__.get(n) is not None), None)
    except Exception as exc:  # noqa: BLE001 - vLLM's zeroer asserts what it supports
        logger.info("vLLM's KV-block zeroer does not fit this model (%s); zeroing layer by layer", exc)
    finally:
        for name in _VLLM_ATTRS:
            runner.__dict__.pop(name, None)
        runner.__dict__.update(saved)
    if built is None or getattr(built, "_meta", None) is None:
        return None
    return built


def _num_blocks(runner: Any) -> int | None:
    return getattr(getattr(runner, "kv_cache_config", None), "num_blocks", None)


def _tensors(kv_caches: Any) -> Any:
    for kv in kv_caches:
        yield from (kv if isinstance(kv, (list, tuple)) else [kv])


def _blocks_dim(tensor: Any, num_blocks: int | None) -> int | None:
    return next((d for d, n in enumerate(tensor.shape) if n == num_blocks), None)
