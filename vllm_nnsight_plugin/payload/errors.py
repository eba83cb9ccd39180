"""The error a refused payload raises (its own module: the codec and the spec
validator both raise it, and the codec calls the validator)."""

from __future__ import annotations


class PayloadError(ValueError):
    """A payload that cannot be accepted; the message names what is wrong."""
