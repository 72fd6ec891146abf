"""OpenTelemetry traces and metrics for hotloop-serve (see ``setup.py`` and ``instruments.py``)."""

from hotloop_serve.telemetry.instruments import Telemetry
from hotloop_serve.telemetry.setup import configure_telemetry

__all__ = ["Telemetry", "configure_telemetry"]
