"""Failures a caller can be told about. Every message is one or two short spoken sentences.

The agent turns these into livekit `ToolError`s; nothing here knows LiveKit.
"""

from __future__ import annotations


class HotelError(Exception):
    """A failure whose `message` the model can read out (or act on) as it is."""

    code = "error"

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class InvalidRequest(HotelError):
    """The arguments cannot be used: wrong type, missing, out of range, impossible dates."""

    code = "invalid_request"


class SoldOut(HotelError):
    """No room of the wanted kind is free on at least one night of the stay."""

    code = "sold_out"


class NotFound(HotelError):
    """No reservation matches the confirmation code and surname (never says which one was wrong)."""

    code = "not_found"


class NotAllowed(HotelError):
    """The request is valid but the hotel's rules forbid it (a cancelled or started stay)."""

    code = "not_allowed"


class Busy(HotelError):
    """The database stayed locked or kept conflicting beyond the retry budget."""

    code = "busy"

    def __init__(
        self, message: str = "The reservation system is busy; please try again in a moment."
    ) -> None:
        super().__init__(message)
