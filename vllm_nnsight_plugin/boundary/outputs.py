"""``RequestOutput.saves`` and ``.ran_as``: what an intervention saved and how it
ran, on vLLM's own output; and the tensor frames results arrive in."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ..payload import codec
from ..payload.values import resolve_frames


def raw_results(output: Any) -> Any:
    """A ``RequestOutput``'s (or ``EngineCoreOutput``'s) results as they came (None when
    it carried no payload)."""
    return (getattr(output, "kv_transfer_params", None) or {}).get(codec.PAYLOAD_KEY)


def _saves_property(raw_of: Callable[[Any], Any], doc: str, whole_output: bool = False) -> property:
    """``.saves``, decoded from the raw results ``raw_of`` finds on the object (until
    the client sets them: then those). ``whole_output``: the object is a request's
    output, on which a saved ``tracer.result`` is taken."""
    def saves(self: Any) -> dict[str, Any]:
        cached = self.__dict__.get("_nnsight_saves")
        if cached is not None:
            return cached
        if whole_output:
            from ..client.result_paths import decoded_results

            res = decoded_results(self, raw_of(self))[0]
        else:
            res = codec.decode_results(raw_of(self))
        return res.saves if res is not None else {}

    return property(saves, _set_saves, doc=doc)


def _set_saves(self: Any, value: dict[str, Any]) -> None:
    self.__dict__["_nnsight_saves"] = value


def _ran_as(self: Any) -> str | None:
    # (read from the raw results: decoding every save to answer this would cost a
    # second full decode)
    return codec.ran_as_of(raw_results(self))


SEQUENCE_RESULTS = "_nnsight_results"  # on a CompletionOutput of a request with n > 1: its sequence's


def install_sequence_saves(completion_output_cls: type) -> None:
    """``outputs[i].saves``: what sequence ``i``'s block saved (a request with ``n > 1``)."""
    if "saves" not in completion_output_cls.__dict__:
        completion_output_cls.saves = _saves_property(lambda c: c.__dict__.get(SEQUENCE_RESULTS),
                                                      "Values this sequence's nnsight intervention saved.")


def install_saves_property(request_output_cls: type) -> None:
    if "saves" not in request_output_cls.__dict__:
        request_output_cls.saves = _saves_property(raw_results, "Values saved by nnsight interventions.", True)
    if "ran_as" not in request_output_cls.__dict__:
        request_output_cls.ran_as = property(_ran_as, doc="How the request's interventions ran: 'batched', "
                                                          "or 'code: <file>:<line> (<why>)'; ';'-joined.")


def install_frames(decoder_cls: type) -> None:
    """Results carry tensor data as uint8 arrays, which vLLM's msgpack sends as frames
    of their own (no copy into the message, none out of it). Its decoder only turns them
    back into arrays where a field is typed as one; ``kv_transfer_params`` is not, so
    the frames are put into the results here, while the decoder still has them."""
    from . import patching

    def make(original: Callable) -> Callable:
        def decode(self: Any, bufs: Any) -> Any:
            out = original(self, bufs)
            outputs = getattr(out, "outputs", None)
            if outputs and isinstance(outputs, list):
                frames = bufs if isinstance(bufs, (list, tuple)) else (bufs,)
                for eco in outputs:
                    params = getattr(eco, "kv_transfer_params", None)
                    if params and codec.PAYLOAD_KEY in params:
                        resolve_frames(params[codec.PAYLOAD_KEY], frames)
            return out

        return decode

    patching.patch_method(decoder_cls, "decode", make)
