"""Bounds at the connection and the ASGI edge, before a request reaches the gateway's handlers:

- `edge_protocol(limits)`: uvicorn's httptools protocol with three more bounds: request line plus headers
  above `max_header_bytes` are a 431 (the connection closes; at most one read of 256 KiB is ever held beyond
  the bound); headers still arriving `header_timeout_seconds` after a connection's or request's first byte
  (slow-loris) are a 408 and the connection closes; a client that reads nothing of its response while the
  gateway has more than the transport's high-water mark (64 KiB) queued for `send_timeout_seconds` is
  disconnected, which aborts its engine request like any disconnect.

Request slots (per key from arrival, the process's shared ones once the body is in) are slots.py's.
"""

from __future__ import annotations

import json
import logging

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from services.common.errors import error_body

from . import metrics

log = logging.getLogger("swiftkv.gateway")

REASONS = {408: b"Request Timeout", 431: b"Request Header Fields Too Large"}


def edge_protocol(limits) -> type[HttpToolsProtocol]:
    """The protocol class for `uvicorn.run(http=...)` with the bounds of the config's `limits`."""

    class EdgeProtocol(HttpToolsProtocol):
        max_header_bytes = limits.max_header_bytes
        header_timeout = limits.header_timeout_seconds
        send_timeout = limits.send_timeout_seconds

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._in_headers = True  # waiting for (the rest of) a request line and headers
            self._header_bytes = 0  # exact: request line and header fields parsed so far
            self._raw_bytes = 0  # coarse: bytes received while in headers (bounds httptools' own buffer)
            self._refusal: tuple[int, str, str] | None = None
            self._refused = False
            self._header_timer = self.loop.call_later(self.header_timeout, self._headers_too_slow)
            self._send_timer = None

        # ---- header size and time ----------------------------------------------------------------
        def data_received(self, data: bytes) -> None:
            if self._refused:
                return
            if self._in_headers:
                self._raw_bytes += len(data)
            super().data_received(data)
            if self._refusal is None and self._in_headers and self._raw_bytes > self.max_header_bytes + 8192:
                self._too_large()
            if self._refusal is not None:
                self._refuse(*self._refusal)

        def on_message_begin(self) -> None:
            super().on_message_begin()
            self._in_headers = True
            self._header_bytes = 0
            if self._header_timer is None:
                self._header_timer = self.loop.call_later(self.header_timeout, self._headers_too_slow)

        def on_url(self, url: bytes) -> None:
            self._count(len(url))
            super().on_url(url)

        def on_header(self, name: bytes, value: bytes) -> None:
            self._count(len(name) + len(value) + 4)
            if self._refusal is None:
                super().on_header(name, value)

        def on_headers_complete(self) -> None:
            if self._refusal is not None or self._refused:
                return
            self._in_headers = False
            self._raw_bytes = 0
            self._cancel_header_timer()
            super().on_headers_complete()

        def on_body(self, body: bytes) -> None:
            if self._refusal is None and not self._refused:
                super().on_body(body)

        def on_message_complete(self) -> None:
            if self._refusal is None and not self._refused:
                super().on_message_complete()

        def _count(self, n: int) -> None:
            self._header_bytes += n
            if self._refusal is None and self._header_bytes > self.max_header_bytes:
                self._too_large()

        def _too_large(self) -> None:
            self._refusal = (431, f"request line and headers exceed the limit of {self.max_header_bytes} bytes "
                                  "(limits.max_header_bytes)", "request_header_fields_too_large")
            metrics.rejections.labels("header_too_large", "live").inc()

        def _headers_too_slow(self) -> None:
            self._header_timer = None
            if self._in_headers and not self._refused and not self.transport.is_closing():
                metrics.rejections.labels("header_timeout", "live").inc()
                self._refuse(408, f"request headers not received within {self.header_timeout:g} s "
                                  "(limits.header_timeout_seconds)", "request_timeout")

        def _cancel_header_timer(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None

        def _refuse(self, status: int, message: str, code: str) -> None:
            """Answer in OpenAI's envelope outside any request cycle, then close the connection."""
            self._refused = True
            self._cancel_header_timer()
            self._unset_keepalive_if_required()
            if self.cycle is not None and not self.cycle.response_complete:  # a pipelined request's answer is being sent
                self.transport.abort()
                return
            body = json.dumps(error_body(message, code=code)).encode()
            head = (b"HTTP/1.1 %d %s\r\ncontent-type: application/json\r\ncontent-length: %d\r\nconnection: close\r\n\r\n"
                    % (status, REASONS[status], len(body)))
            if not self.transport.is_closing():
                self.transport.write(head + body)
                self.transport.close()

        # ---- a client that stopped reading --------------------------------------------------------
        def pause_writing(self) -> None:
            super().pause_writing()
            if self._send_timer is None:
                self._send_timer = self.loop.call_later(self.send_timeout, self._reader_stalled)

        def resume_writing(self) -> None:
            super().resume_writing()
            if self._send_timer is not None:
                self._send_timer.cancel()
                self._send_timer = None

        def _reader_stalled(self) -> None:
            self._send_timer = None
            if self.flow.write_paused:
                log.warning("client %s read nothing for %.0f s with a full send buffer: disconnected",
                            "%s:%d" % self.client if self.client else "?", self.send_timeout)
                metrics.slow_client_disconnects.inc()
                self.transport.abort()  # connection_lost -> the request sees a disconnect -> engine request aborted

        def connection_lost(self, exc) -> None:
            self._cancel_header_timer()
            if self._send_timer is not None:
                self._send_timer.cancel()
                self._send_timer = None
            super().connection_lost(exc)

    return EdgeProtocol

