"""``n > 1`` on a traced request: one traced request per sequence.

vLLM's front end fans a request with ``n > 1`` out into ``n`` child requests, one per
sequence, each with a copy of the parent's ``SamplingParams`` (so of its payload): in
the engine each child is a traced request of its own and runs its own copy of the
block, as nnsight runs one per sequence. Here, in the front end:

- each child gets a prefix-cache salt of its own (a read must see its prompt computed,
  not taken from a sibling's cache; an edit-only spec's shared salt stays shared, as
  for any two requests with that spec);
- each sequence's results go onto its ``CompletionOutput`` (``outputs[i].saves``),
  and the parent's ``RequestOutput`` carries all of them, by sequence index
  (``{"sequences": [...]}``, None for a sequence without results).

Only the children's states take the wraps (their class is switched to a subclass),
so other requests pay one call, at admission. The front end refuses ``n > 1`` on a
traced request whose outputs stream (``frontend.check_sequences``): only a whole
output (vLLM's ``FINAL_ONLY``) holds every sequence.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ..payload import codec
from . import patching
from .outputs import SEQUENCE_RESULTS
from .whole_prompts import keep_whole, traced

_ARRIVING = "_nnsight_arriving"  # on a child's state, while vLLM makes its output


def _add_request(original: Callable) -> Callable:
    def add_request(self: Any, request: Any, prompt: Any, parent_req: Any = None, request_index: int = 0,
                    *args: Any, **kwargs: Any) -> Any:
        if parent_req is None or not traced(request):
            return original(self, request, prompt, parent_req, request_index, *args, **kwargs)
        if keep_whole(request):  # (a salt of its own, not an edit-only spec's shared one)
            request.cache_salt = f"{request.cache_salt}#{request_index}"  # (children are copies: assigned)
        out = original(self, request, prompt, parent_req, request_index, *args, **kwargs)
        state = self.request_states.get(request.request_id)
        if state is not None:
            state.__class__ = patching.subclass_with(type(state), _WRAPS)
        return out

    return add_request


def _make_request_output(original: Callable) -> Callable:
    def make_request_output(self: Any, new_token_ids: Any, pooling_output: Any, finish_reason: Any,
                            stop_reason: Any, kv_transfer_params: dict[str, Any] | None = None,
                            *args: Any, **kwargs: Any) -> Any:
        raw = (kv_transfer_params or {}).get(codec.PAYLOAD_KEY)
        if raw is not None:  # (the child's own: it goes onto its CompletionOutput instead)
            kv_transfer_params = {k: v for k, v in kv_transfer_params.items() if k != codec.PAYLOAD_KEY} or None
            self.__dict__[_ARRIVING] = raw
        try:
            out = original(self, new_token_ids, pooling_output, finish_reason, stop_reason, kv_transfer_params,
                           *args, **kwargs)
        finally:
            self.__dict__.pop(_ARRIVING, None)
        completions = getattr(out, "outputs", None)
        if isinstance(completions, list):
            each: list[Any] = [None] * self.parent_req.n
            for completion in completions:
                each[completion.index] = completion.__dict__.get(SEQUENCE_RESULTS)
            if any(r is not None for r in each):
                params = dict(out.kv_transfer_params or {})
                params[codec.PAYLOAD_KEY] = {codec.SEQUENCES: each}
                out.kv_transfer_params = params
        return out

    return make_request_output


def _new_completion_output(original: Callable) -> Callable:
    def new_completion_output(self: Any, *args: Any, **kwargs: Any) -> Any:
        out = original(self, *args, **kwargs)
        raw = self.__dict__.get(_ARRIVING)
        if raw is not None:
            out.__dict__[SEQUENCE_RESULTS] = raw
        return out

    return new_completion_output


_WRAPS = (("make_request_output", _make_request_output), ("_new_completion_output", _new_completion_output))


def install(output_processor_cls: type) -> None:
    patching.patch_method(output_processor_cls, "add_request", _add_request)
