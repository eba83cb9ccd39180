"""``RequestOutput.saves`` and ``.ran_as``: what an intervention saved and how it
ran, on vLLM's own output."""

from __future__ import annotations

from typing import Any

from ..payload import codec


def results_of(output: Any) -> codec.Results | None:
    """Decoded results on a ``RequestOutput`` (None when it carried no payload)."""
    params = getattr(output, "kv_transfer_params", None) or {}
    return codec.decode_results(params.get(codec.PAYLOAD_KEY))


def _saves(self: Any) -> dict[str, Any]:
    cached = self.__dict__.get("_nnsight_saves")
    if cached is not None:
        return cached
    res = results_of(self)
    return res.saves if res is not None else {}


def _set_saves(self: Any, value: dict[str, Any]) -> None:
    self.__dict__["_nnsight_saves"] = value


def _ran_as(self: Any) -> str | None:
    res = results_of(self)
    return res.ran_as if res is not None else None


def install_saves_property(request_output_cls: type) -> None:
    if "saves" not in request_output_cls.__dict__:
        request_output_cls.saves = property(_saves, _set_saves, doc="Values saved by nnsight interventions.")
    if "ran_as" not in request_output_cls.__dict__:
        request_output_cls.ran_as = property(_ran_as, doc="How the request's interventions ran: 'batched', "
                                                          "or 'code: <file>:<line> (<why>)'; ';'-joined.")
