"""Server-sent events for streamed completions: the event encoding, a response that notices a client
going away, and the hook that releases a stream's resources however it ended.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator

import anyio
from fastapi.responses import StreamingResponse


# Line breaks to str.splitlines (and so to httpx's iter_lines) that JSON leaves unescaped: an SSE
# event whose text holds one would reach such clients cut in two. Escaped, the JSON is the same.
_SPLITLINES_EXTRA = str.maketrans({"\x85": "\\u0085", "\u2028": "\\u2028", "\u2029": "\\u2029"})


def sse(data: dict | str) -> str:
    text = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False).translate(_SPLITLINES_EXTRA)
    return f"data: {text}\n\n"


class DisconnectAwareStream(StreamingResponse):
    """Streams while listening for the client going away; either way the body iterator is closed,
    so its ``finally`` cancels the engine request and frees its KV blocks at once (starlette's own
    ASGI>=2.4 path only notices a disconnect at the next send and leaves the generator to the GC)."""

    async def __call__(self, scope, receive, send) -> None:
        async with anyio.create_task_group() as tg:
            async def stream() -> None:
                try:
                    await self.stream_response(send)
                except OSError:
                    pass  # the client went away while we were sending
                tg.cancel_scope.cancel()

            tg.start_soon(stream)
            await self.listen_for_disconnect(receive)
            tg.cancel_scope.cancel()
        await self.body_iterator.aclose()


async def call_at_end(gen: AsyncIterator[str], on_end) -> AsyncIterator[str]:
    """Run ``on_end(completed)`` once the stream ends, is cancelled or the client disconnects."""
    ok = False
    try:
        async for item in gen:
            yield item
        ok = True
    finally:
        try:
            await gen.aclose()
        finally:
            on_end(ok)
