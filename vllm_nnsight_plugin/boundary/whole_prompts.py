"""Traced prompts are scheduled whole, with chunked prefill on (vLLM's default).

A block (or a batched read) sees a request's prompt as the rows of one step; chunked
prefill would hand it the first chunk and compute the rest later, after the block
has read or edited. So the scheduler keeps such a prompt in one step: when it does
not fit the step's remaining token budget it waits for a later step, exactly as
every prompt does with chunked prefill off (vLLM's own rule, applied per request).
Untraced requests and edit-only batched specs (which apply to every chunk) are
chunked as usual. A prompt longer than the whole budget is still split, and the
worker ends that request with an error naming ``max_num_batched_tokens``.

How: while ``schedule()`` runs with such a request waiting, the scheduler's config is
seen through :class:`_PerRequest`, whose ``enable_chunked_prefill`` answers for the
waiting request vLLM is looking at (the last one its waiting queue's
``peek_request`` returned).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

from . import engine_core, patching

SALT_PREFIX = "nnsight-"  # the front end salts every traced request's prefix cache with this

_CONSIDERED: list[Any] = [None]  # while scheduling(): the waiting request schedule() looks at
_NONE_YET = object()  # scheduling() holds, no request peeked yet (None: not scheduling)
SHARED_SPEC_SALT = SALT_PREFIX + "spec-"  # edit-only batched specs: they apply to every chunk


def traced(request: Any) -> bool:
    """A request the plugin traced (the front end salts every one of them)."""
    salt = getattr(request, "cache_salt", None)
    return isinstance(salt, str) and salt.startswith(SALT_PREFIX)


def keep_whole(request: Any) -> bool:
    """A traced request whose prompt a block or a read must see in one step."""
    return traced(request) and not request.cache_salt.startswith(SHARED_SPEC_SALT)


class _PerRequest:
    """The scheduler config, with ``enable_chunked_prefill`` off for the request the
    scheduler is considering when that request must be scheduled whole."""

    def __init__(self, config: Any):
        object.__setattr__(self, "_config", config)

    @property
    def enable_chunked_prefill(self) -> bool:
        config = self._config
        request = _CONSIDERED[0]
        if not config.enable_chunked_prefill or request is None or request is _NONE_YET \
                or not keep_whole(request):
            return config.enable_chunked_prefill
        # a prompt longer than the whole budget can never be whole: split it (the worker fails it)
        return request.num_tokens - request.num_computed_tokens > config.max_num_batched_tokens

    def __getattr__(self, name: str) -> Any:
        return getattr(self._config, name)

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self._config, name, value)


@contextlib.contextmanager
def scheduling(scheduler: Any) -> Iterator[None]:
    """Around one ``schedule()`` call (see the module docstring)."""
    config = scheduler.scheduler_config
    if not config.enable_chunked_prefill or not any(keep_whole(r) for r in engine_core.waiting_requests(scheduler)):
        yield
        return
    scheduler.scheduler_config = _PerRequest(config)
    _CONSIDERED[0] = _NONE_YET
    try:
        yield
    finally:
        scheduler.scheduler_config = config
        _CONSIDERED[0] = None


def _peek(original: Callable) -> Callable:
    def peek_request(self: Any, *args: Any, **kwargs: Any) -> Any:
        request = original(self, *args, **kwargs)
        if _CONSIDERED[0] is not None:
            _CONSIDERED[0] = request
        return request

    return peek_request


def install_queue(queue_cls: type) -> None:
    """(``schedule()`` itself is wrapped once, in :mod:`.kv_blocks`, which enters
    :func:`scheduling`.)"""
    patching.patch_method(queue_cls, "peek_request", _peek)
