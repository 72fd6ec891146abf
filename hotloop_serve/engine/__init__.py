"""The engine: many hot sessions over one llama.cpp context (knows nothing of Ray or gRPC)."""

from hotloop_serve.engine.chat_template import ChatMessage, ChatTemplate
from hotloop_serve.engine.config import EngineOptions
from hotloop_serve.engine.engine import Engine, EngineStats, SessionInfo
from hotloop_serve.engine.settings import SamplingSettings
from hotloop_serve.engine.stream import Chunk, RequestStream, Timings, Usage

__all__ = [
    "ChatMessage",
    "ChatTemplate",
    "Chunk",
    "Engine",
    "EngineOptions",
    "EngineStats",
    "RequestStream",
    "SamplingSettings",
    "SessionInfo",
    "Timings",
    "Usage",
]
