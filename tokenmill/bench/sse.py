"""Incremental Server-Sent Events parsing for streamed OpenAI responses.

The load generator times every event by when its bytes arrived, so the parser must work on raw byte chunks
as they come off the socket (a line-based reader would hide when an event actually completed). It follows
the SSE rules the servers we drive rely on: events end at a blank line, `data:` lines of one event join with
newlines, lines starting with ':' are comments (pings), and `\\n`, `\\r\\n` and `\\r` all end lines.
"""

from __future__ import annotations

import codecs

DONE = "[DONE]"


class SSEParser:
    """Feed byte chunks, get back the `data` payload of each event that the chunk completed."""

    def __init__(self) -> None:
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._pending = ""  # text after the last complete line
        self._data: list[str] = []  # data lines of the event being read

    def feed(self, chunk: bytes) -> list[str]:
        text = self._pending + self._decoder.decode(chunk)
        lines = text.splitlines(keepends=True)
        self._pending = ""
        if lines and not lines[-1].endswith(("\n", "\r")):
            self._pending = lines.pop()
        elif lines and lines[-1].endswith("\r"):
            # A lone '\r' may be the first half of '\r\n': keep it until the next byte says which.
            self._pending = lines.pop()
        events = []
        for line in lines:
            event = self._line(line.rstrip("\r\n"))
            if event is not None:
                events.append(event)
        return events

    def close(self) -> list[str]:
        """Flush the last event when the stream ends without its blank line."""
        events = self.feed(b"\n\n") if (self._pending or self._data) else []
        return events

    def _line(self, line: str) -> str | None:
        if not line:
            if not self._data:
                return None
            event, self._data = "\n".join(self._data), []
            return event
        if line.startswith(":"):
            return None
        field, _, value = line.partition(":")
        if field == "data":
            self._data.append(value.removeprefix(" "))
        return None
