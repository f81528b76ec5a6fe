"""The tools the model sees: one pydantic model per tool renders its function schema (`tool_specs`) and
validates what the model sent (`parse_args`), any failure becoming one `InvalidRequest` sentence. Knows the
arguments and their bounds; nothing about LiveKit, the database or what a tool does.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field, ValidationError
from pydantic_core import PydanticCustomError

from . import guests, rules
from .errors import InvalidRequest

MAX_GUESTS = 12
MAX_NIGHTS_FIELD = 30


def _no_bool(value: Any) -> Any:
    # pydantic's lax mode reads true as 1; a boolean is never a count of guests or nights.
    if isinstance(value, bool):
        raise ValueError("must be a whole number")
    return value


def _name_as_sent(value: Any) -> Any:
    # before the ends are stripped: ten thousand spaces and "Al" is not a name; refused as any name too long
    if isinstance(value, str) and len(value) > guests.NAME_SENT_MAX:
        message = "String should have at most {max_length} characters"
        raise PydanticCustomError("string_too_long", message, {"max_length": guests.NAME_MAX})
    return value


def _visible(value: Any) -> Any:
    # every text a tool takes loses its invisible characters the same way (names and contacts: their cleaners)
    return guests.visible(value) if isinstance(value, str) else value


def _name(value: str) -> str:
    return guests.clean_name(value)


def _contact(value: str) -> str:
    return guests.clean_contact(value)


def _code(value: str) -> str:
    code = rules.normalize_code(value)
    if len(code) != rules.CODE_LENGTH:
        raise ValueError(f"a confirmation code has {rules.CODE_LENGTH} letters and digits")
    return code


# Bounds before the validator, or pydantic cannot render them as JSON-schema minimum/maximum.
Guests = Annotated[int, Field(ge=1, le=MAX_GUESTS), BeforeValidator(_no_bool)]
Nights = Annotated[int, Field(ge=1, le=MAX_NIGHTS_FIELD), BeforeValidator(_no_bool)]
DateText = Annotated[str, Field(min_length=1, max_length=40), BeforeValidator(_visible)]
Name = Annotated[str, BeforeValidator(_name_as_sent), AfterValidator(_name)]
RoomType = Annotated[str, Field(min_length=1, max_length=40), BeforeValidator(_visible)]
Code = Annotated[str, BeforeValidator(_visible), AfterValidator(_code)]

_CHECK_IN = (
    "Arrival date as YYYY-MM-DD, or as the caller said it: today, tomorrow, Friday, the 12th, March 12."
)
_CHECK_OUT = "Departure date, same forms as check_in. Give check_out or nights."
_NIGHTS = "Number of nights, if the caller gave a length instead of a departure date."
_GUESTS = "Number of guests staying in the room, adults and children."
_ROOM_TYPE = "Room type as the caller said it, for example standard, deluxe or suite."


def _code_field(description: str) -> Any:
    """The confirmation code a reservation is looked up by, with the `description` the model reads."""
    return Field(min_length=1, max_length=40, title="confirmation code", description=description)


def _last_name_field() -> Any:
    """The last name a reservation is looked up by, checked with its confirmation code."""
    return Field(
        min_length=1, max_length=80, title="last name", description="The last name on the reservation."
    )


class _Args(BaseModel):
    model_config = ConfigDict(extra="forbid", str_strip_whitespace=True, frozen=True)


ToolArgs = (
    _Args  # the base of every tool's arguments, for tools defined outside the hotel (agent/phone/phone.py)
)


class CheckAvailability(_Args):
    """Find which rooms are free for a stay, with the total price including tax. Call it before
    offering a booking."""

    check_in: DateText = Field(title="check-in date", description=_CHECK_IN)
    check_out: DateText | None = Field(None, title="check-out date", description=_CHECK_OUT)
    nights: Nights | None = Field(None, title="number of nights", description=_NIGHTS)
    guests: Guests = Field(title="number of guests", description=_GUESTS)
    room_type: RoomType | None = Field(None, title="room type", description=_ROOM_TYPE + " Omit to see all.")


class BookRoom(_Args):
    """Book one room once the caller has confirmed the name, dates and room. Returns the
    confirmation code to read back."""

    guest_name: Name = Field(
        min_length=1, max_length=80, title="guest name", description="Full name of the guest, as confirmed."
    )
    contact: Annotated[str, AfterValidator(_contact)] = Field(
        min_length=3,
        max_length=120,
        title="phone number or email",
        description="Phone number of the guest, with + and the country code, or their email address.",
    )
    check_in: DateText = Field(title="check-in date", description=_CHECK_IN)
    check_out: DateText | None = Field(None, title="check-out date", description=_CHECK_OUT)
    nights: Nights | None = Field(None, title="number of nights", description=_NIGHTS)
    guests: Guests = Field(title="number of guests", description=_GUESTS)
    room_type: RoomType = Field(title="room type", description=_ROOM_TYPE)


class FindReservation(_Args):
    """Look up an existing reservation by its confirmation code and the guest's last name."""

    confirmation_code: Code = _code_field("The 8-character confirmation code as the caller read it.")
    last_name: Name = _last_name_field()


class ChangeOrCancelReservation(_Args):
    """Change the dates, room type or guests of a reservation, or cancel it under the hotel's policy.
    Needs the confirmation code and last name."""

    confirmation_code: Code = _code_field("The reservation's confirmation code.")
    last_name: Name = _last_name_field()
    action: Literal["change", "cancel"] = Field(
        title="action", description="change to modify the reservation, cancel to cancel it."
    )
    check_in: DateText | None = Field(
        None, title="new check-in date", description="New arrival date, when changing the dates."
    )
    check_out: DateText | None = Field(
        None, title="new check-out date", description="New departure date, when changing the dates."
    )
    nights: Nights | None = Field(None, title="number of nights", description="New number of nights.")
    room_type: RoomType | None = Field(
        None, title="new room type", description="New room type, when changing it."
    )
    guests: Guests | None = Field(None, title="number of guests", description="New number of guests.")
    accept_fee: bool = Field(
        False,
        title="fee accepted",
        description="true only after the caller agreed to the cancellation fee the tool quoted.",
    )


class ManageReservation(ChangeOrCancelReservation):
    """Look up, change or cancel an existing reservation. Needs the confirmation code and last name;
    find reads the reservation back, change modifies its dates, room type or guests, cancel cancels it
    under the hotel's policy."""

    action: Literal["find", "change", "cancel"] = Field(  # type: ignore[assignment]
        title="action",
        description="find to read the reservation back, change to modify it, cancel to cancel it.",
    )

    def step(self) -> FindReservation | ChangeOrCancelReservation:
        """The single-step tool this call stands for (a lookup ignores change fields it was given)."""
        if self.action == "find":
            return FindReservation.model_construct(
                confirmation_code=self.confirmation_code, last_name=self.last_name
            )
        return ChangeOrCancelReservation.model_construct(**dict(self))


class HotelInfo(_Args):
    """Answer a question about the hotel: hours, check-in and check-out times, parking, breakfast,
    wifi, pets, pool, cancellation policy and more."""

    topic: Annotated[str, BeforeValidator(_visible)] = Field(
        min_length=1,
        max_length=100,
        title="topic",
        description="What the caller asked about, in a few words, for example parking or breakfast hours.",
    )


TOOLS: dict[str, type[_Args]] = {
    "check_availability": CheckAvailability,
    "book_room": BookRoom,
    "find_reservation": FindReservation,
    "change_or_cancel_reservation": ChangeOrCancelReservation,
    "hotel_info": HotelInfo,
    "manage_reservation": ManageReservation,
}

# The model accepts at most five tools, so the set follows the call's steps: check availability, book, find a
# reservation, change or cancel it, and answer questions about the hotel.
WEB_TOOLS = (
    "check_availability",
    "book_room",
    "find_reservation",
    "change_or_cancel_reservation",
    "hotel_info",
)
# A phone call also needs call control (agent/phone/phone.py), so on the phone finding, changing and
# cancelling a reservation are one tool, `manage_reservation`, whose action picks the step: the three take the
# same confirmation code and last name, and the model already picks change or cancel by an action.
PHONE_TOOLS = ("check_availability", "book_room", "manage_reservation", "hotel_info")


# --- rendering ---------------------------------------------------------------------------------------


def _describe(model: type[BaseModel]) -> str:
    return " ".join((model.__doc__ or "").split())


def _clean(node: Any) -> Any:
    """A compact JSON schema for the prompt: no titles or string lengths, `X | None` as an optional X."""
    if isinstance(node, list):
        return [_clean(item) for item in node]
    if not isinstance(node, dict):
        return node
    node = dict(node)
    variants = node.get("anyOf")
    if variants and len(variants) == 2 and {"type": "null"} in variants:
        (kept,) = [v for v in variants if v != {"type": "null"}]
        del node["anyOf"]
        node = {**kept, **node}
    for key in ("title", "minLength", "maxLength"):  # lengths are enforced, and explained, on validation
        node.pop(key, None)
    if node.get("default", 0) is None:
        del node["default"]
    return {key: _clean(value) for key, value in node.items()}


def _parameters(model: type[BaseModel]) -> dict[str, Any]:
    parameters = _clean(model.model_json_schema())
    parameters.pop("description", None)  # the docstring is the tool's description already
    return parameters


def function_schema(name: str, model: type[BaseModel]) -> dict[str, Any]:
    """An argument model as an OpenAI-style function schema: {name, description, parameters}."""
    return {"name": name, "description": _describe(model), "parameters": _parameters(model)}


def tool_schema(name: str) -> dict[str, Any]:
    """One hotel tool as an OpenAI-style function schema: {name, description, parameters}."""
    return function_schema(name, TOOLS[name])


def tool_specs(names: tuple[str, ...] = WEB_TOOLS) -> list[dict[str, Any]]:
    return [tool_schema(name) for name in names]


# --- validation --------------------------------------------------------------------------------------


def _label(model: type[_Args], loc: tuple[Any, ...]) -> str:
    field = model.model_fields.get(str(loc[0])) if loc else None
    return (field.title if field and field.title else str(loc[0] if loc else "request")).strip()


def _sentence(model: type[_Args], error: Mapping[str, Any]) -> str:
    kind = error["type"]
    loc = tuple(error.get("loc", ()))
    label = _label(model, loc)
    ctx = error.get("ctx") or {}
    if kind == "missing":
        return f"I still need the {label}."
    if kind in ("int_type", "int_parsing", "int_from_float"):
        return f"The {label} must be a whole number."
    if kind in ("greater_than_equal", "less_than_equal", "greater_than", "less_than"):
        prop = _parameters(model)["properties"].get(str(loc[0]), {})
        prop = prop.get("anyOf", [prop])[0]
        return f"The {label} must be between {prop.get('minimum')} and {prop.get('maximum')}."
    if kind in ("string_type", "bool_type", "bool_parsing"):
        expected = "true or false" if kind.startswith("bool") else "text"
        return f"The {label} must be {expected}."
    if kind == "string_too_long":
        return f"The {label} is too long; it can be at most {ctx.get('max_length')} characters."
    if kind == "string_too_short":
        return f"The {label} is empty." if ctx.get("min_length") == 1 else f"The {label} is too short."
    if kind == "literal_error":
        return f"The {label} must be one of {ctx.get('expected')}."
    if kind == "value_error":
        reason = str(ctx.get("error", error.get("msg", ""))).rstrip(".")
        if reason.startswith("must "):
            return f"The {label} {reason}."
        return f"The {label} is not valid: {reason}."
    if kind == "model_type":
        return "The arguments must be a JSON object."
    return f"The {label} is not valid."


def _hidden(what: str, name: str, hidden: str) -> str:
    return (
        f"The {what} name {rules.clip(name, 30)!r} contains an invisible character, {hidden}; "
        "send the name without it."
    )


def explain(model: type[_Args], exc: ValidationError) -> str:
    """One short paragraph naming every problem (at most three), without echoing long input."""
    sentences: list[str] = []
    unknown: list[str] = []
    for error in exc.errors(include_url=False, include_input=False):
        if error["type"] == "extra_forbidden":
            key = str(error["loc"][0]) if error["loc"] else "?"
            if hidden := rules.hidden_character(key):  # its echo would read as a field the tool takes
                sentence = _hidden("field", key, hidden)
            else:
                unknown.append(repr(rules.clip(key, 30)))
                continue
        else:
            sentence = _sentence(model, error)
        if sentence not in sentences:
            sentences.append(sentence)
    if unknown:
        sentences.append(
            f"This tool does not take {', '.join(unknown[:3])}; "
            f"its fields are {', '.join(model.model_fields)}."
        )
    more = len(sentences) - 3
    text = " ".join(sentences[:3])
    if more > 0:
        text += f" ({more} more problem{'s' if more > 1 else ''}.)"
    return text


def parse_args(name: str, raw: Any) -> _Args:
    """Validate the model's arguments for tool `name`; raises `InvalidRequest` with a readable reason."""
    model = TOOLS.get(name)
    if model is None:
        if hidden := rules.hidden_character(str(name)):
            raise InvalidRequest(_hidden("tool", str(name), hidden))
        raise InvalidRequest(f"There is no tool called {rules.clip(str(name))!r}.")
    if isinstance(raw, model):
        return raw
    if not isinstance(raw, Mapping):
        raise InvalidRequest("The arguments must be a JSON object.")
    try:
        return model.model_validate(dict(raw))
    except ValidationError as exc:
        raise InvalidRequest(explain(model, exc)) from None
