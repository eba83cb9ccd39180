"""What a module's ``forward`` returns, read from its annotation: the recorder
checks a block's indexing against it, and a cache reads a tuple element by element."""

from __future__ import annotations

import functools
import typing

import torch


@functools.lru_cache(maxsize=256)
def output_structure(cls: type) -> int | None:
    """What ``cls.forward`` returns, by its annotation: 0 for a tensor, N for a tuple
    of N tensors, None when unannotated or anything else (a union, an optional)."""
    try:
        ret = typing.get_type_hints(cls.forward).get("return")
    except Exception:  # noqa: BLE001 - an unresolvable annotation is an unknown structure
        return None
    if ret is torch.Tensor:
        return 0
    args = typing.get_args(ret)
    if typing.get_origin(ret) is tuple and args and Ellipsis not in args \
            and all(a is torch.Tensor for a in args):
        return len(args)
    return None
