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


class NotSetUp(HotelError):
    """The database holds no hotel yet (`python -m tools seed` makes one)."""

    code = "not_set_up"

    def __init__(self) -> None:
        super().__init__("The reservation system is not available right now; the front desk can help.")


class Busy(HotelError):
    """The database stayed locked, kept conflicting, lost its connection or did not answer within the call's
    deadline, and nothing was changed."""

    code = "busy"

    def __init__(
        self, message: str = "The reservation system is busy; please try again in a moment."
    ) -> None:
        super().__init__(message)


class AlreadyExists(HotelError):
    """What was asked for would make a second record with a key one already has (the same booking made
    again): nothing was changed, and asking again would be refused again."""

    code = "already_exists"

    def __init__(
        self,
        message: str = (
            "That booking already exists, so nothing new was made. Find it with its confirmation code "
            "rather than making it again."
        ),
    ) -> None:
        super().__init__(message)


class Unconfirmed(HotelError):
    """A change reached the database but its confirmation was lost (the connection failed during COMMIT) and
    the database could not be asked in time whether it was made. Asking again is safe: a booking carries
    its idempotency key, and a change or a cancellation that was made is found as made."""

    code = "unconfirmed"

    def __init__(
        self,
        message: str = (
            "The reservation system stopped answering before it confirmed this, so it may or may not have "
            "gone through. Don't tell the caller it failed: in a moment, make the same request again; it "
            "will not be done twice, and the answer will say how it stands."
        ),
    ) -> None:
        super().__init__(message)
