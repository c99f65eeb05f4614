"""Server-sent events read as the spec reads them, for hylo's own clients (`hylo bench serve`,
`benchmarks/server_soak.py`).

A line ends only at CR, LF or CRLF (html.spec.whatwg.org, "Interpreting an event stream"). Python's
`str.splitlines` — and so httpx's `aiter_lines` — also splits at U+2028, U+2029, U+0085, U+000B,
U+000C and U+001C..U+001E, which JSON strings may carry raw: a reader built on it cuts such an event
in two. Lines are split on the bytes here, before decoding: none of those characters' UTF-8 bytes is
CR or LF, and a character cut between two network chunks is decoded whole.
"""

from __future__ import annotations

import re
from collections.abc import AsyncIterable, AsyncIterator

_LINE_END = re.compile(rb"\r\n|\r|\n")


class SSEDecoder:
    """Incremental: `feed` network bytes, get the data of each event they complete.

    An event's data is its `data` fields joined by LF (one space after the colon dropped); a blank
    line ends the event; comments (`:` lines) and other fields are ignored; an event the stream
    ends in the middle of is dropped, as the spec says."""

    def __init__(self) -> None:
        self._buffer = b""
        self._data: list[str] = []
        self._first_line = True

    def feed(self, chunk: bytes) -> list[str]:
        self._buffer += chunk
        events = []
        for line in self._complete_lines():
            if line == "":
                if self._data:
                    events.append("\n".join(self._data))
                self._data = []
                continue
            name, colon, value = line.partition(":")
            if name == "data" and colon:
                self._data.append(value[1:] if value.startswith(" ") else value)
            elif name == "data":
                self._data.append("")
        return events

    def _complete_lines(self) -> list[str]:
        lines, start = [], 0
        for end in _LINE_END.finditer(self._buffer):
            if end.group() == b"\r" and end.end() == len(self._buffer):
                break  # perhaps the CR of a CRLF whose LF is in the next chunk
            lines.append(self._buffer[start : end.start()].decode("utf-8", errors="replace"))
            start = end.end()
        self._buffer = self._buffer[start:]
        if lines and self._first_line:
            lines[0] = lines[0].removeprefix("\ufeff")  # a byte-order mark may open the stream
        self._first_line = self._first_line and not lines
        return lines

    def close(self) -> list[str]:
        """The events the stream's last bytes complete: a final CR ends its line."""
        return self.feed(b"\n") if self._buffer.endswith(b"\r") else []


async def sse_events(chunks: AsyncIterable[bytes]) -> AsyncIterator[str]:
    """The data of each event in a byte stream (e.g. httpx's `response.aiter_bytes()`)."""
    decoder = SSEDecoder()
    async for chunk in chunks:
        for data in decoder.feed(chunk):
            yield data
    for data in decoder.close():
        yield data
