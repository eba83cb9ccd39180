"""Arrange every patch; each applies when vLLM imports the patched module."""

from __future__ import annotations


def install() -> None:
    from . import (
        frontend,
        kv_blocks,
        patching,
        results,
        rpc,
        runner_v1,
        runner_v2,
        sequences,
        server_routes,
        server_streams,
        whole_prompts,
    )
    from .outputs import install_frames, install_saves_property, install_sequence_saves

    patching.when_class(patching.RUNNER_V1, runner_v1.install)
    patching.when_class(patching.RUNNER_CPU, runner_v1.install_load_model)
    patching.when_class(patching.RUNNER_V2, runner_v2.install)
    patching.when_class(patching.SCHEDULER, results.install)
    patching.when_class(patching.SCHEDULER, kv_blocks.install_scheduler)
    for queue in patching.WAITING_QUEUES:
        patching.when_class(queue, whole_prompts.install_queue)
    patching.when_class(patching.KV_CACHE_MANAGER, kv_blocks.install_kv_manager)
    patching.when_class(patching.SINGLE_TYPE_MANAGER, kv_blocks.install_single_type_manager)
    patching.when_class(patching.RUNNER_V1, kv_blocks.install_runner)
    patching.when_class(patching.RUNNER_V2, kv_blocks.install_runner)
    patching.when_class(patching.INPUT_PROCESSOR, frontend.install)
    patching.when_class(patching.WORKER_BASE, rpc.install)
    patching.when_class(patching.ENGINE_CORE, rpc.install_engine_core)
    patching.when_class(patching.REQUEST_OUTPUT, install_saves_property)
    patching.when_class(patching.COMPLETION_OUTPUT, install_sequence_saves)
    patching.when_class(patching.MSGPACK_DECODER, install_frames)
    patching.when_class(patching.SERVING_COMPLETION, server_streams.install_completion)
    patching.when_class(patching.SERVING_CHAT, server_streams.install_chat)
    patching.when_class(patching.OUTPUT_PROCESSOR, server_streams.install_output_processor)
    patching.when_class(patching.OUTPUT_PROCESSOR, sequences.install)
    for module_name, _ in patching.APP_ROUTE_HOOKS:
        patching.when_imported(module_name, server_routes.install)
