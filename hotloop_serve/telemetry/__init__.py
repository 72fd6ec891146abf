"""OpenTelemetry traces and metrics, and request logs, for hotloop-serve (``setup.py``,
``instruments.py``, ``semconv.py``, ``request_log.py``)."""

from hotloop_serve.telemetry.instruments import RpcSpan, Telemetry
from hotloop_serve.telemetry.request_log import configure_request_log
from hotloop_serve.telemetry.setup import configure_telemetry

__all__ = ["RpcSpan", "Telemetry", "configure_request_log", "configure_telemetry"]
