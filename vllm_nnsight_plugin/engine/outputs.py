"""``RequestOutput.saves``: what an intervention saved, on vLLM's own output."""

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


def install_saves_property(request_output_cls: type) -> None:
    if "saves" not in request_output_cls.__dict__:
        request_output_cls.saves = property(_saves, _set_saves, doc="Values saved by nnsight interventions.")
