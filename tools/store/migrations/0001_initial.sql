-- The hotel, its room types, inventory per room type per night, reservations and the FAQ.
-- Money is integer cents. `{date}`, `{timestamp}` (UTC) and `{bigint}` are the dialect's column types
-- (tools/store/schema.py: on SQLite dates and timestamps are ISO-8601 text).

CREATE TABLE hotel (
    id                     INTEGER PRIMARY KEY CHECK (id = 1),
    name                   TEXT    NOT NULL,
    timezone               TEXT    NOT NULL,
    currency               TEXT    NOT NULL,
    tax_rate_bp            INTEGER NOT NULL CHECK (tax_rate_bp BETWEEN 0 AND 10000),
    free_cancel_days       INTEGER NOT NULL CHECK (free_cancel_days >= 0),
    late_cancel_fee_nights INTEGER NOT NULL CHECK (late_cancel_fee_nights >= 0),
    max_nights             INTEGER NOT NULL CHECK (max_nights > 0),
    booking_horizon_days   INTEGER NOT NULL CHECK (booking_horizon_days > 0),
    check_in_time          TEXT    NOT NULL,
    check_out_time         TEXT    NOT NULL
);

CREATE TABLE room_types (
    code        TEXT    PRIMARY KEY,
    name        TEXT    NOT NULL UNIQUE,
    description TEXT    NOT NULL,
    max_guests  INTEGER NOT NULL CHECK (max_guests > 0),
    sort_order  INTEGER NOT NULL DEFAULT 0
);

CREATE TABLE inventory (
    room_type  TEXT    NOT NULL REFERENCES room_types (code),
    night      {date}  NOT NULL,
    total      INTEGER NOT NULL CHECK (total >= 0),
    booked     INTEGER NOT NULL DEFAULT 0 CHECK (booked >= 0),
    rate_cents INTEGER NOT NULL CHECK (rate_cents >= 0),
    PRIMARY KEY (room_type, night),
    CHECK (booked <= total)
);

CREATE TABLE reservations (
    code                   TEXT        PRIMARY KEY,
    idempotency_key        TEXT        UNIQUE,
    status                 TEXT        NOT NULL CHECK (status IN ('confirmed', 'cancelled')),
    guest_name             TEXT        NOT NULL,
    contact                TEXT        NOT NULL,
    room_type              TEXT        NOT NULL REFERENCES room_types (code),
    check_in               {date}      NOT NULL,
    check_out              {date}      NOT NULL,
    guests                 INTEGER     NOT NULL CHECK (guests > 0),
    subtotal_cents         {bigint}    NOT NULL CHECK (subtotal_cents >= 0),
    tax_cents              {bigint}    NOT NULL CHECK (tax_cents >= 0),
    total_cents            {bigint}    NOT NULL CHECK (total_cents = subtotal_cents + tax_cents),
    cancellation_fee_cents {bigint}    NOT NULL DEFAULT 0 CHECK (cancellation_fee_cents >= 0),
    created_at             {timestamp} NOT NULL,
    updated_at             {timestamp} NOT NULL,
    CHECK (check_out > check_in)
);

CREATE INDEX reservations_stay ON reservations (room_type, check_in);

CREATE TABLE faq (
    topic    TEXT PRIMARY KEY,
    keywords TEXT NOT NULL,
    answer   TEXT NOT NULL
);
