"""FastAPI's own OpenTelemetry instrumentation is on only where OpenTelemetry is configured."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from oss_api.app import _opentelemetry_configured, create_app
from shared.flows import load_flows
from shared.testing import InProcess

SUPPORT = Path(__file__).resolve().parents[1] / "support"


@pytest.mark.parametrize(
    ("environ", "configured"),
    [
        ({}, False),
        ({"FASTAPI_OTEL_AUTO_CONFIGURE": "false", "ASYNCFLOW_HOME": "/x"}, False),
        ({"FASTAPI_OTEL_AUTO_CONFIGURE": "TRUE"}, True),
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4318"}, True),
        ({"OTEL_SERVICE_NAME": "asyncflow-api"}, True),
        ({"OTEL_SDK_DISABLED": "true", "OTEL_SERVICE_NAME": "asyncflow-api"}, False),
        ({"OTEL_SDK_DISABLED": "false"}, True),
    ],
)
def test_configured_by_an_otel_variable_or_fastapi_s_own(environ: dict[str, str], configured: bool) -> None:
    assert _opentelemetry_configured(environ) is configured


@pytest.mark.parametrize("configured", [False, True])
def test_the_app_asks_for_it_only_when_configured(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, configured: bool
) -> None:
    for name in [n for n in os.environ if n.startswith("OTEL_")]:
        monkeypatch.delenv(name)
    monkeypatch.delenv("FASTAPI_OTEL_AUTO_CONFIGURE", raising=False)
    if configured:
        monkeypatch.setenv("OTEL_SERVICE_NAME", "asyncflow-api")
    app = create_app(InProcess(load_flows(SUPPORT / "flows.yaml"), tmp_path).runtime)
    settings = app._telemetry  # FastAPI's merged settings: its defaults, or ours
    assert (settings["tracing"], settings["metrics"], settings["logs"]) == (configured,) * 3
