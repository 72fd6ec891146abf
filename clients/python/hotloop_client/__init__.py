"""hotloop_client: the Python SDK of hotloop-serve (blocking and asyncio).

    from hotloop_client import Client, Message, Role, Settings

    with Client("localhost:9000") as client:
        session = client.model("gemma-3-270m").new_session(settings=Settings(seed=1))
        history = [Message(Role.USER, "Hello!")]
        for chunk in session.generate(history):
            print(chunk.text, end="", flush=True)

Everything public is re-exported here; the ``_private`` modules may change at any time.
"""

from ._async_client import AsyncClient, AsyncModel, AsyncSession
from ._base import assistant_message, with_message_replaced, without_last_reply
from ._client import Client, Model, Session
from ._errors import (
    Cancelled,
    DeadlineExceeded,
    FailedPrecondition,
    HotloopError,
    InternalError,
    InvalidArgument,
    NotFound,
    OutOfRange,
    PermissionDenied,
    ResourceExhausted,
    TurnInterrupted,
    Unauthenticated,
    Unavailable,
)
from ._types import (
    Chunk,
    FinishReason,
    Message,
    ModelInfo,
    Role,
    ServedBy,
    SessionInfo,
    Settings,
    Timings,
    TokenLogprob,
    Tool,
    ToolCall,
    ToolCallDelta,
    Usage,
)

__version__ = "0.1.0"

__all__ = [
    "AsyncClient",
    "AsyncModel",
    "AsyncSession",
    "Cancelled",
    "Chunk",
    "Client",
    "DeadlineExceeded",
    "FailedPrecondition",
    "FinishReason",
    "HotloopError",
    "InternalError",
    "InvalidArgument",
    "Message",
    "Model",
    "ModelInfo",
    "NotFound",
    "OutOfRange",
    "PermissionDenied",
    "ResourceExhausted",
    "Role",
    "ServedBy",
    "Session",
    "SessionInfo",
    "Settings",
    "Timings",
    "TokenLogprob",
    "Tool",
    "ToolCall",
    "ToolCallDelta",
    "TurnInterrupted",
    "Unauthenticated",
    "Unavailable",
    "Usage",
    "assistant_message",
    "with_message_replaced",
    "without_last_reply",
]
