"""The engine adapter: everything that runs inside vLLM's processes."""

from __future__ import annotations


def install() -> None:
    """Arrange every patch; each applies when vLLM imports the patched module."""
    from . import compat, frontend, isolation, results, rpc, runner_v1, runner_v2, whole_prompts
    from .outputs import install_frames, install_saves_property

    compat.when_class(compat.RUNNER_V1, runner_v1.install)
    compat.when_class(compat.RUNNER_CPU, runner_v1.install_load_model)
    compat.when_class(compat.RUNNER_V2, runner_v2.install)
    compat.when_class(compat.SCHEDULER, results.install)
    compat.when_class(compat.SCHEDULER, isolation.install_scheduler)
    for queue in compat.WAITING_QUEUES:
        compat.when_class(queue, whole_prompts.install_queue)
    compat.when_class(compat.KV_CACHE_MANAGER, isolation.install_kv_manager)
    compat.when_class(compat.BLOCK_POOL, isolation.install_block_pool)
    compat.when_class(compat.INPUT_PROCESSOR, frontend.install)
    compat.when_class(compat.WORKER_BASE, rpc.install)
    compat.when_class(compat.ENGINE_CORE, rpc.install_engine_core)
    compat.when_class(compat.REQUEST_OUTPUT, install_saves_property)
    compat.when_class(compat.MSGPACK_DECODER, install_frames)

    from .. import serve

    serve.install()
