"""multipart/form-data parsed as it arrives: small fields kept, file bytes handed on at once.

The router forwards an upload to the coordinator chunk by chunk, so its memory stays flat
whatever the file's size (Starlette's form parser would spool the whole file first).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Any

from python_multipart.exceptions import FormParserError
from python_multipart.multipart import MultipartParser, parse_options_header

from serve_app.errors import APIError

MAX_FIELD_BYTES = 64 * 1024  # purpose and the like; a file part has no such bound.


@dataclass(frozen=True)
class FieldValue:
    name: str
    value: str


@dataclass(frozen=True)
class FileStart:
    name: str
    filename: str


@dataclass(frozen=True)
class FileData:
    data: bytes


Event = FieldValue | FileStart | FileData


def bad_upload(message: str) -> APIError:
    return APIError(
        f"{message} Send multipart/form-data with a `file` part and a `purpose` field "
        "(the openai client does: client.files.create(file=..., purpose='batch')).",
        code="invalid_upload",
    )


class MultipartStream:
    def __init__(self, content_type: str) -> None:
        kind, params = parse_options_header(content_type)
        boundary = params.get(b"boundary")
        if kind != b"multipart/form-data" or not boundary:
            raise bad_upload("Not a multipart/form-data body.")
        self._events: list[Event] = []
        self._header_name = b""
        self._header_value = b""
        self._disposition = b""
        self._field: tuple[str, bytearray] | None = None  # The field part being read.
        self._parser = MultipartParser(
            boundary,
            {
                "on_part_begin": self._begin,
                "on_part_data": self._data,
                "on_part_end": self._end,
                "on_header_field": self._name,
                "on_header_value": self._value,
                "on_header_end": self._header_end,
                "on_headers_finished": self._headers_finished,
            },
        )

    def feed(self, chunk: bytes) -> list[Event]:
        """Events the chunk completes (file bytes as they come)."""
        try:
            self._parser.write(chunk)
        except FormParserError as exc:
            raise bad_upload(f"Invalid multipart body ({exc}).") from None
        events, self._events = self._events, []
        return events

    def finish(self) -> list[Event]:
        try:
            self._parser.finalize()
        except FormParserError as exc:
            raise bad_upload(f"Invalid multipart body ({exc}).") from None
        events, self._events = self._events, []
        return events

    def _begin(self) -> None:
        self._disposition, self._field = b"", None

    def _name(self, data: bytes, start: int, end: int) -> None:
        self._header_name += data[start:end]

    def _value(self, data: bytes, start: int, end: int) -> None:
        self._header_value += data[start:end]

    def _header_end(self) -> None:
        if self._header_name.lower() == b"content-disposition":
            self._disposition = self._header_value
        self._header_name, self._header_value = b"", b""

    def _headers_finished(self) -> None:
        _, options = parse_options_header(self._disposition)
        name = options.get(b"name", b"").decode(errors="replace")
        if b"filename" in options:
            filename = options[b"filename"].decode(errors="replace")
            self._events.append(FileStart(name, filename))
        else:
            self._field = (name, bytearray())

    def _data(self, data: bytes, start: int, end: int) -> None:
        if self._field is None:
            self._events.append(FileData(bytes(data[start:end])))
            return
        value = self._field[1]
        value += data[start:end]
        if len(value) > MAX_FIELD_BYTES:
            raise bad_upload(f"Form field {self._field[0]!r} is too long.")

    def _end(self) -> None:
        if self._field is not None:
            name, value = self._field
            self._events.append(FieldValue(name, value.decode(errors="replace")))
            self._field = None


class ChunkWriter:
    """Writes a stream's chunks at their offsets with up to ``in_flight`` writes at once, so
    forwarding keeps pace with the client; the first failed write fails the next call."""

    def __init__(
        self, write: Callable[[int, bytes], Coroutine[Any, Any, object]], in_flight: int
    ) -> None:
        self._write, self._in_flight = write, in_flight
        self._tasks: set[asyncio.Task[object]] = set()
        self.offset = 0

    async def send(self, chunk: bytes) -> None:
        while len(self._tasks) >= self._in_flight:
            await self._reap(asyncio.FIRST_COMPLETED)
        self._tasks.add(asyncio.create_task(self._write(self.offset, chunk)))
        self.offset += len(chunk)

    async def flush(self) -> None:
        while self._tasks:
            await self._reap(asyncio.ALL_COMPLETED)

    async def _reap(self, when: str) -> None:
        done, self._tasks = await asyncio.wait(self._tasks, return_when=when)
        for task in done:
            task.result()  # Raises the write's error.

    async def cancel(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks.clear()
