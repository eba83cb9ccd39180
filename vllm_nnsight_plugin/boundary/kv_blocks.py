"""No traced request leaves KV state that another request reads.

An edit can put NaN or inf into a request's KV cache. When its blocks return to the
pool and are handed to another request, the new owner writes only the slots it uses;
an attention kernel that masks the rest by multiplying with a zero probability still
reads them, and 0 x NaN is NaN. So the scheduler tracks the blocks of every traced
request (a request whose cache salt is the plugin's) when it frees them, and the
worker zeroes them before the next owner's step (how: :mod:`.kv_zeroing`):

- a finished request whose salt is its own (every traced request's but an edit-only
  spec's, whose salt requests of that spec share; the front end gives a caller's salt
  that looks like the plugin's a prefix of its own: ``frontend``) leaves blocks no
  prefix-cache lookup can ever hit: they are zeroed before the next step, all of a
  step's finished requests' blocks in one pass (a batch of requests that finish
  together: one pass);
- blocks that may still be hit (an edit-only spec's, whose KV is its spec's to share;
  a preempted request's, which it takes back when it resumes; those a running request
  drops, e.g. a sliding-window layer's blocks the window has left) or that vLLM returns
  to the pool later (a free deferred past an in-flight step) are remembered, and
  zeroed when the block pool hands one out again, before the step that uses it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from . import engine_core, kv_zeroing, patching, whole_prompts
from .whole_prompts import keep_whole, traced

DIRTY = "_nnsight_dirty_blocks"  # on the block pool: ids freed by traced requests
RUNNING = "_nnsight_traced_running"  # on the block pool: ids of the traced requests the scheduler holds
PENDING = "_nnsight_blocks_to_zero"  # on the block pool: dirty ids handed out again, to zero
ZERO_ATTR = "nnsight_zero_blocks"  # on a SchedulerOutput: ids the worker zeroes before the step


# ----------------------------------------------------------- scheduler (EngineCore)


def _held(manager: Any, request: Any) -> tuple[list[int], bool]:
    """The block ids a traced request holds, and whether each is known to be the
    manager's pool's (a group of another pool, e.g. a host-memory one, is left out;
    where the groups' pools cannot be told, False)."""
    try:
        groups = manager.get_block_ids(request.request_id)
    except Exception:  # noqa: BLE001 - a request with no blocks (yet)
        return [], False
    managers = getattr(getattr(manager, "coordinator", None), "single_type_managers", None)
    pool = manager.block_pool
    if managers is None or len(managers) != len(groups):
        return [i for ids in groups for i in ids], False
    return [i for m, ids in zip(managers, groups) if getattr(m, "block_pool", None) is pool for i in ids], True


def _freed(manager: Any, request: Any, ids: list[int], now: bool) -> None:
    """After a traced request's blocks went back: to zero before the next step (``now``:
    a finished request's blocks the pool holds free, which no lookup can hit unless its
    salt is shared), else when handed out again."""
    pool = manager.block_pool
    if now and keep_whole(request):
        null = getattr(getattr(pool, "null_block", None), "block_id", None)
        free = {i for i in ids if pool.blocks[i].ref_cnt == 0 and i != null}
        pool.__dict__.setdefault(PENDING, []).extend(free)
        ids = [i for i in ids if i not in free]  # (still held: zeroed once handed out again)
        if not ids:
            return
    _mark_dirty(pool, ids)


def _mark_dirty(pool: Any, ids: Any) -> None:
    """Blocks to zero when the pool hands them out again: while it has any, the pool's
    class is one whose ``get_new_blocks`` looks (a pool with none pays no call). The
    null block (a sliding window's tables hold it) and ids past the pool's end (another
    pool's, where a request's groups' pools cannot be told) are never handed out here:
    left out, or the pool would look for them for good."""
    null = getattr(getattr(pool, "null_block", None), "block_id", None)
    size = len(pool.blocks)
    ids = [i for i in ids if i != null and 0 <= i < size]
    if not ids:
        return
    pool.__dict__.setdefault(DIRTY, set()).update(ids)
    pool.__class__ = patching.subclass_with(type(pool), _LOOKING)  # (a switched pool's class: as it is)


def _dropping(original: Callable) -> Callable:
    """A running traced request's blocks it no longer reads (out of a sliding window)
    go back to the pool with their KV: remembered, to zero when handed out again. As
    vLLM walks them: back from the range's end to the first block it already dropped."""
    def drop(self: Any, request_id: str, first_block: int, last_block: int, *args: Any, **kwargs: Any) -> Any:
        pool = self.block_pool
        blocks = self.req_to_blocks.get(request_id) if request_id in pool.__dict__.get(RUNNING, ()) else None
        ids = []
        for i in range(min(last_block, len(blocks)) - 1, first_block - 1, -1) if blocks else ():
            if getattr(blocks[i], "is_null", False):
                break
            ids.append(blocks[i].block_id)
        out = original(self, request_id, first_block, last_block, *args, **kwargs)
        if ids:  # (a block another holder still counts too: zeroed once it is handed out again)
            _mark_dirty(pool, ids)
        return out

    return drop


def _freeing(original: Callable, now: bool) -> Callable:
    """``free`` returns the blocks to the pool (``now``); ``pop_blocks_for_free`` hands
    them to vLLM, which returns them after an in-flight step."""
    def free(self: Any, request: Any, *args: Any, **kwargs: Any) -> Any:
        if not traced(request):
            return original(self, request, *args, **kwargs)
        ids, exact = _held(self, request)
        out = original(self, request, *args, **kwargs)
        is_finished = getattr(request, "is_finished", None)
        finished = is_finished is not None and is_finished()
        if ids:
            _freed(self, request, ids, now and exact and finished)
        if finished:
            self.block_pool.__dict__.get(RUNNING, set()).discard(request.request_id)
        return out

    return free


def _get_new_blocks(original: Callable) -> Callable:
    def get_new_blocks(self: Any, *args: Any, **kwargs: Any) -> Any:
        blocks = original(self, *args, **kwargs)
        dirty = self.__dict__.get(DIRTY)
        if dirty:
            pending = self.__dict__.setdefault(PENDING, [])
            for block in blocks:
                if block.block_id in dirty:
                    dirty.discard(block.block_id)
                    pending.append(block.block_id)
        if not dirty:  # (none left to look for: the pool's own class again)
            self.__class__ = type(self).__bases__[0]
        return blocks

    return get_new_blocks


_LOOKING = ((patching.BLOCK_POOL_ALLOCATE, _get_new_blocks),)  # a pool with dirty blocks: its class's wrap


def _schedule(original: Callable) -> Callable:
    def schedule(self: Any, *args: Any, **kwargs: Any) -> Any:
        pool = engine_core.scheduler_block_pool(self)
        if pool is not None and not pool.__dict__.get(RUNNING):  # (no traced request held: none waits)
            output = original(self, *args, **kwargs)
        else:
            with whole_prompts.scheduling(self):  # (the one wrap of schedule(): both happen here)
                output = original(self, *args, **kwargs)
        pending = pool.__dict__.get(PENDING) if pool is not None else None
        if pending:
            setattr(output, ZERO_ATTR, list(pending))
            pending.clear()
        return output

    return schedule


def _adding(original: Callable) -> Callable:
    """A traced request's id, known to the pool from the moment the scheduler takes it
    (blocks it drops before its first step too, e.g. after an asynchronous KV load)."""
    def add_request(self: Any, request: Any, *args: Any, **kwargs: Any) -> Any:
        if traced(request):
            pool = engine_core.scheduler_block_pool(self)
            if pool is not None:
                pool.__dict__.setdefault(RUNNING, set()).add(request.request_id)
        return original(self, request, *args, **kwargs)

    return add_request


def install_scheduler(scheduler_cls: type) -> None:
    patching.patch_method(scheduler_cls, "schedule", _schedule)
    patching.patch_method(scheduler_cls, "add_request", _adding)


def install_kv_manager(manager_cls: type) -> None:
    for name in patching.KV_MANAGER_FREES:
        if hasattr(manager_cls, name):
            patching.patch_method(manager_cls, name, lambda original, n=name: _freeing(original, n == "free"))


def install_single_type_manager(manager_cls: type) -> None:
    patching.patch_method(manager_cls, patching.KV_MANAGER_DROP, _dropping)


# ----------------------------------------------------------------- worker

def _allocating(original: Callable) -> Callable:
    def initialize_kv_cache(self: Any, *args: Any, **kwargs: Any) -> Any:
        out = original(self, *args, **kwargs)
        if kwargs.get("is_profiling", args[1] if len(args) > 1 else False):
            kv_zeroing.forget(self)  # (a throwaway cache vLLM frees by dropping it: hold no view of it)
        else:
            kv_zeroing.prepare(self)
        return out

    return initialize_kv_cache


def install_runner(runner_cls: type) -> None:
    """Each runner finds how to zero its layers' blocks once its KV cache exists."""
    patching.patch_method(runner_cls, "initialize_kv_cache", _allocating)


def zero_reused_blocks(runner: Any, scheduler_output: Any) -> None:
    """Before a step: zero the blocks traced requests held that are now handed out again."""
    ids = getattr(scheduler_output, ZERO_ATTR, None)
    if ids:
        kv_zeroing.zero(runner, ids)
