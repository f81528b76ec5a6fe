"""Chorus's spans sent through the worker's own export (agent/telemetry.py: redacted, bounded) to memory, for
the tracing tests."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from agent import telemetry


@contextlib.contextmanager
def exported_spans(settings: telemetry.TraceSettings) -> Iterator[Callable[[], tuple]]:
    """Installs a provider that exports to memory; yields `read()`, the finished spans once flushed."""
    memory = InMemorySpanExporter()
    provider = telemetry.build_provider(memory, "test", settings)
    telemetry.install(provider)

    def read():
        provider.force_flush(5000)
        return memory.get_finished_spans()

    try:
        yield read
    finally:
        telemetry.install(None)
        provider.shutdown()
