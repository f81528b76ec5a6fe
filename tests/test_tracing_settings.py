"""The `OTEL_*` settings as the worker reads them and hands them to its engine's process
(envsettings/traces.py): what the worker read comes back whole on the engine's side, names not its own are
left out, and a bad value is refused in one line naming the variable."""

from __future__ import annotations

import pytest

from envsettings import SettingsError
from envsettings.traces import TraceSettings


def test_the_settings_the_worker_read_come_back_whole_on_the_engines_side():
    read = TraceSettings(
        endpoint="http://collector:4318",
        protocol="grpc",
        disabled=False,
        service_name="hotel-a",
        resource_attributes="deployment.environment=prod",
        sampler="parentbased_traceidratio",
        sampler_arg=0.25,
        max_queue_size=100,
        export_timeout_ms=500,
    )
    variables = read.variables()
    assert variables["OTEL_EXPORTER_OTLP_ENDPOINT"] == "http://collector:4318"
    assert variables["OTEL_TRACES_SAMPLER_ARG"] == "0.25" and "OTEL_SDK_DISABLED" not in variables
    assert all(isinstance(v, str) for v in variables.values())  # as an environment holds them
    assert TraceSettings.from_variables(variables) == read
    assert TraceSettings().variables() == {} and not TraceSettings.from_variables({}).on


def test_an_environments_other_names_are_left_out_and_a_bad_value_is_refused_in_one_line():
    got = TraceSettings.from_variables(
        {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318", "OTEL_EXPORTER_OTLP_HEADERS": "k=v", "PATH": "/bin"}
    )
    assert got.on and got.endpoint == "http://c:4318"
    off = {"OTEL_SDK_DISABLED": "true", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318"}
    assert not TraceSettings.from_variables(off).on
    with pytest.raises(SettingsError) as e:
        TraceSettings.from_variables({"OTEL_BSP_MAX_QUEUE_SIZE": "0"})
    assert str(e.value) == "OTEL_BSP_MAX_QUEUE_SIZE=0: must be a whole number from 1 to 1000000"
