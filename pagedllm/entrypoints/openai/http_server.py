"""The HTTP layer around the app: uvicorn's protocol with connection limits, and a server whose
shutdown ends in-flight requests cleanly.

uvicorn 0.54 has ``timeout_keep_alive`` (idle connections between requests) and
``limit_concurrency`` (503 once a request *arrives* on a connection over the limit), but no timeout
for reading a request: a client that sends its headers a byte at a time (slowloris) holds its
connection, and a file handle, forever. ``guarded_http_protocol`` adds both bounds at the protocol
level, before any parsing: a connection over ``--limit-concurrency`` is answered 503 and closed
at once, and a request whose headers and body are not all received within
``--timeout-request-read`` seconds has its connection closed.
"""
from __future__ import annotations

import asyncio
import json
import logging
import time
from typing import Callable, Optional

import uvicorn
from uvicorn.protocols.http.auto import AutoHTTPProtocol

logger = logging.getLogger("pagedllm")

_LOG_EVERY_S = 10.0
_LINGER_S = 1.0  # a refused connection is closed this long after its 503 (its input is discarded)


class _RateLimitedLog:
    """One warning per ``_LOG_EVERY_S`` with the count since the last one (an attack must not flood the log)."""

    def __init__(self, message: str) -> None:
        self.message, self.count, self.last = message, 0, 0.0

    def __call__(self, *args) -> None:
        self.count += 1
        now = time.monotonic()
        if now - self.last >= _LOG_EVERY_S:
            logger.warning(self.message + " (%d since the last such line)", *args, self.count)
            self.count, self.last = 0, now


def _busy_response(limit: int) -> bytes:
    body = json.dumps({"error": {
        "message": f"Too many open connections (--limit-concurrency {limit}); try again later.",
        "type": "service_unavailable", "param": None, "code": "too_many_connections"}}).encode()
    return (b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\nconnection: close\r\n"
            b"content-length: %d\r\n\r\n" % len(body)) + body


def guarded_http_protocol(limit_concurrency: Optional[int], timeout_request_read: Optional[float]) -> type:
    """uvicorn's HTTP protocol class (h11 or httptools, as uvicorn picks) with an open-connection
    limit and a deadline for receiving each request (headers and body). None disables either."""
    busy = _busy_response(limit_concurrency) if limit_concurrency else b""
    log_refused = _RateLimitedLog("refused a connection: %d connections are open (--limit-concurrency)")
    log_slow = _RateLimitedLog("closed a connection that did not send its request within %.0f s "
                               "(--timeout-request-read)")

    class GuardedHTTPProtocol(AutoHTTPProtocol):
        _refused = False
        _read_timer: Optional[asyncio.TimerHandle] = None

        def connection_made(self, transport) -> None:
            if limit_concurrency is not None and len(self.connections) >= limit_concurrency:
                self._refused = True
                log_refused(len(self.connections))
                transport.write(busy)
                # Half-close and linger briefly: closing with the client's request unread would
                # send a TCP reset, which can destroy the 503 before the client reads it.
                if transport.can_write_eof():
                    transport.write_eof()
                asyncio.get_running_loop().call_later(_LINGER_S, transport.close)
                return
            super().connection_made(transport)
            self._arm()

        def connection_lost(self, exc) -> None:
            if self._refused:
                return
            self._disarm()
            super().connection_lost(exc)

        def data_received(self, data: bytes) -> None:
            if self._refused:
                return
            super().data_received(data)
            cycle = self.cycle
            if cycle is None or cycle.response_complete or cycle.more_body:
                self._arm()  # a request is (still) arriving: the deadline runs from its first byte
            else:
                self._disarm()

        def _arm(self) -> None:
            if self._read_timer is None and timeout_request_read is not None:
                self._read_timer = self.loop.call_later(timeout_request_read, self._read_timed_out)

        def _disarm(self) -> None:
            if self._read_timer is not None:
                self._read_timer.cancel()
                self._read_timer = None

        def _read_timed_out(self) -> None:
            self._read_timer = None
            cycle = self.cycle
            waiting = cycle is None or cycle.response_complete or cycle.more_body
            if waiting and not self.transport.is_closing():
                log_slow(timeout_request_read)
                self.transport.close()

    return GuardedHTTPProtocol


def ensure_file_limit(limit_concurrency: Optional[int], spare: int = 256) -> None:
    """Raise the soft open-files limit so ``limit_concurrency`` connections (plus ``spare`` for the
    model, logs and libraries) fit, as vLLM does at start-up; warn when the hard limit is lower."""
    if not limit_concurrency:
        return
    try:
        import resource  # lazily: POSIX only
    except ImportError:  # not on POSIX
        return
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    need = limit_concurrency + spare
    if soft != resource.RLIM_INFINITY and soft < need:
        target = need if hard == resource.RLIM_INFINITY else min(need, hard)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        except (ValueError, OSError):
            target = soft
        if target < need:
            logger.warning("the open-files limit (%d) is below --limit-concurrency %d + %d; lower "
                           "--limit-concurrency or raise ulimit -n", target, limit_concurrency, spare)


class GracefulServer(uvicorn.Server):
    """uvicorn's server whose shutdown, once ``shutdown_timeout`` seconds have passed with requests
    still running, calls ``abort_in_flight()`` (which ends them with finish_reason "abort", so a
    streaming client gets its last chunk and ``[DONE]``); uvicorn's own hard cancel stays as a
    backstop ``backstop_s`` later, for clients that stopped reading."""

    def __init__(self, config: uvicorn.Config, shutdown_timeout: float, abort_in_flight: Callable[[], int],
                 backstop_s: float = 5.0) -> None:
        config.timeout_graceful_shutdown = shutdown_timeout + backstop_s
        super().__init__(config)
        self.shutdown_timeout = shutdown_timeout
        self.abort_in_flight = abort_in_flight

    async def shutdown(self, sockets=None) -> None:
        timer = asyncio.get_running_loop().call_later(self.shutdown_timeout, self._abort)
        try:
            await super().shutdown(sockets)
        finally:
            timer.cancel()

    def _abort(self) -> None:
        n = self.abort_in_flight()
        if n:
            logger.warning("shutdown: %d request(s) still running after --shutdown-timeout %.0f s; aborting them",
                           n, self.shutdown_timeout)
