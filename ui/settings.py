"""The monitoring page's settings from the environment (and `.env`), read with `MonitorSettings.from_env()`.

`CHORUS_MONITOR_URLS`: the workers' snapshot URLs, comma-separated (one worker per GPU); a URL without a path
gets `/snapshot`. `CHORUS_MONITOR_TOKEN`: when set, the page opens only as `...?token=<it>` (`PageAccess`,
read and checked before the other settings).
`CHORUS_MONITOR_REFRESH_S`, `CHORUS_MONITOR_TIMEOUT_S`, `CHORUS_MONITOR_BOOKINGS`.
`CHORUS_TRACE_URL_TEMPLATE`: a trace store's URL for one trace, each live session linked to its call's
(ui/trace_links.py). The bookings database is the tools' own setting (`DATABASE_URL` or `CHORUS_DATA_DIR`,
tools/settings.py).
"""

from __future__ import annotations

from urllib.parse import urlsplit

from pydantic import Field, SecretStr, field_validator

from envsettings import EnvSettings
from ui.trace_links import TEMPLATE, check_template

DEFAULT_URL = "http://127.0.0.1:8090/snapshot"
URLS = "comma-separated http:// or https:// URLs of workers' /snapshot (e.g. http://127.0.0.1:8090/snapshot)"


def snapshot_url(url: str) -> str:
    """`url` with `/snapshot` as its path when it has none; ValueError when it is not an http(s) URL."""
    url = url.strip()
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(URLS)
    return url.rstrip("/") + "/snapshot" if parts.path in ("", "/") else url


def parse_urls(text: str) -> list[str]:
    """Snapshot URLs from a comma- or line-separated list (duplicates dropped, order kept); ValueError on a
    bad one."""
    out: list[str] = []
    for item in text.replace("\n", ",").split(","):
        if item.strip() and (url := snapshot_url(item)) not in out:
            out.append(url)
    return out


class PageAccess(EnvSettings):
    """The page's access token alone (`CHORUS_MONITOR_TOKEN`), read before any other setting: a visitor
    without it must see nothing else, not even why another setting was refused."""

    token: SecretStr | None = Field(
        None, min_length=8, validation_alias="CHORUS_MONITOR_TOKEN", description="at least 8 characters"
    )


class MonitorSettings(PageAccess):
    """Every setting of the page, its token included."""

    urls: str = Field(DEFAULT_URL, validation_alias="CHORUS_MONITOR_URLS", description=URLS)
    refresh_s: float = Field(
        2.0, ge=0.5, le=60, validation_alias="CHORUS_MONITOR_REFRESH_S", description="0.5 to 60 seconds"
    )
    timeout_s: float = Field(
        2.0, gt=0, le=30, validation_alias="CHORUS_MONITOR_TIMEOUT_S", description="above 0, up to 30 seconds"
    )
    bookings: int = Field(
        10, ge=0, le=200, validation_alias="CHORUS_MONITOR_BOOKINGS", description="0 to 200 (0: none shown)"
    )

    trace_url: str = Field("", validation_alias="CHORUS_TRACE_URL_TEMPLATE", description=TEMPLATE)

    @field_validator("trace_url")
    @classmethod
    def _trace_url(cls, value: str) -> str:
        return check_template(value)

    @field_validator("urls")
    @classmethod
    def _urls(cls, value: str) -> str:
        if not parse_urls(value):
            raise ValueError(URLS)
        return value

    @property
    def snapshot_urls(self) -> list[str]:
        return parse_urls(self.urls)
