"""The HTTP server around the app: uvicorn, with the two things it leaves out.

- A timeout on the request head: uvicorn closes an idle keep-alive connection, but a client
  that opens a connection and sends its headers a byte at a time (or never) holds it forever.
  `HeadTimeoutH11Protocol` closes a connection whose request line and headers are not all in
  within `header_read_timeout_s` (for its first request, and for each next one on a
  keep-alive connection once bytes of it arrive). The body has its own timeout, in the app.
- Per-endpoint access logs (vLLM's --disable-access-log-for-endpoints): `AccessLogFilter`
  drops uvicorn's access-log line of a request to one of the paths given (health checks,
  metrics scrapes), whatever its query string.
- Streams that outlive the shutdown grace period: uvicorn cancels their tasks when it ends,
  which cuts the connection mid-event. `Server.shutdown` asks the engine, just before that
  deadline, to end every request still running, so each stream sends an error event and
  [DONE] and closes on its own.
- Certificates renewed while serving (vLLM's --enable-ssl-refresh): `SSLCertRefresher`
  watches the key, certificate and CA files and loads them again into the server's SSL
  context when they change; connections made after that see the new ones, open ones keep
  theirs.

Must not: know the routes or the engine beyond the one `end_all` call.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import ssl
from collections.abc import Iterable
from typing import Any
from urllib.parse import urlsplit

import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from octavo.engine.async_engine import AsyncEngine

logger = logging.getLogger(__name__)

# How long before the shutdown deadline the streams still running are ended.
SHUTDOWN_MARGIN_S = 1.0


class HeadTimeoutH11Protocol(H11Protocol):
    """uvicorn's h11 protocol plus a deadline for each request's head (see the module)."""

    header_read_timeout_s = 30.0

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._head_cycle: Any = None
        self._head_timer: asyncio.TimerHandle | None = None
        self._arm_head_timer()

    def data_received(self, data: bytes) -> None:
        idle = self._head_timer is None and (self.cycle is None or self.cycle.response_complete)
        super().data_received(data)
        if self.cycle is not self._head_cycle:  # a new request's head is complete
            self._head_cycle = self.cycle
            self._cancel_head_timer()
        elif idle and self.cycle is not None and self.cycle.response_complete:
            # The first bytes of a next request on a keep-alive connection: its head is due.
            self._arm_head_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_head_timer()
        super().connection_lost(exc)

    def _arm_head_timer(self) -> None:
        self._cancel_head_timer()
        self._head_timer = self.loop.call_later(self.header_read_timeout_s, self._head_timed_out)

    def _cancel_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_timed_out(self) -> None:
        self._head_timer = None
        in_request = self.cycle is not None and not self.cycle.response_complete
        if not in_request and not self.transport.is_closing():
            logger.info(
                "closed a connection that sent no complete request head in %g s",
                self.header_read_timeout_s,
            )
            self.transport.close()


class SSLCertRefresher:
    """Polls the certificate, key and CA files (their size, modification time and inode, so
    a file renamed over another counts) and loads a changed set into `context`. A load that
    fails (a renewal caught halfway: the new certificate with the old key) is logged and
    tried again once the files change again; the context keeps serving what it had
    meanwhile. No watcher library: three stat calls a second cost nothing next to a
    dependency."""

    poll_interval_s = 1.0

    def __init__(
        self, context: ssl.SSLContext, certfile: str, keyfile: str | None, ca_certs: str | None
    ) -> None:
        self.context = context
        self.certfile, self.keyfile, self.ca_certs = certfile, keyfile, ca_certs
        self._loaded = self._signatures()
        # The files as they were at the last failed load: tried again only once they change.
        self._failed: tuple[tuple[int, ...] | None, ...] | None = None

    def _signatures(self) -> tuple[tuple[int, ...] | None, ...]:
        def signature(path: str | None) -> tuple[int, ...] | None:
            if path is None:
                return None
            try:
                st = os.stat(path)
            except OSError:
                return None
            return (st.st_mtime_ns, st.st_size, st.st_ino)

        return tuple(signature(p) for p in (self.certfile, self.keyfile, self.ca_certs))

    def refresh(self) -> bool:
        """Load the files again if they changed since the last load; True if it did."""
        current = self._signatures()
        if current in (self._loaded, self._failed):
            return False
        try:
            if current[:2] != self._loaded[:2]:
                # A pair that does not match leaves a context half loaded (the new
                # certificate, the old key: every handshake fails), so the pair is tried on a
                # scratch context first.
                ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER).load_cert_chain(self.certfile, self.keyfile)
                self.context.load_cert_chain(self.certfile, self.keyfile)
            if self.ca_certs is not None and current[2] != self._loaded[2]:
                self.context.load_verify_locations(self.ca_certs)
        except (OSError, ssl.SSLError) as exc:
            self._failed = current
            logger.warning(
                "reloading the HTTPS certificates failed (tried again when the files change): %s",
                exc,
            )
            return False
        self._loaded = current
        logger.info("reloaded the HTTPS certificates from %s", self.certfile)
        return True

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.poll_interval_s)
            self.refresh()


ACCESS_LOGGER = "uvicorn.access"


class AccessLogFilter(logging.Filter):
    """Drops uvicorn's access-log records of requests to `paths`. uvicorn logs each request
    with args (client, method, path with query string, HTTP version, status)."""

    def __init__(self, paths: Iterable[str]) -> None:
        super().__init__()
        self.paths = frozenset(paths)

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args
        if record.name != ACCESS_LOGGER or not isinstance(args, tuple) or len(args) < 3:
            return True
        return urlsplit(str(args[2])).path not in self.paths


def access_log_paths(text: str | None) -> tuple[str, ...]:
    """--disable-access-log-for-endpoints: comma-separated paths, e.g. /health,/metrics."""
    return tuple(path.strip() for path in (text or "").split(",") if path.strip())


class Server(uvicorn.Server):
    """uvicorn.Server that ends the engine's requests just before the shutdown deadline, and
    that reloads its certificates as they change when `ssl_refresh` is set; it holds its
    access-log filter (if any) on uvicorn's access logger while it lives."""

    def __init__(
        self,
        config: uvicorn.Config,
        async_engine: AsyncEngine,
        ssl_refresh: bool = False,
        access_log_filter: AccessLogFilter | None = None,
    ) -> None:
        super().__init__(config)
        self.async_engine = async_engine
        self.ssl_refresh = ssl_refresh
        self.access_log_filter = access_log_filter
        if access_log_filter is not None:
            logging.getLogger(ACCESS_LOGGER).addFilter(access_log_filter)
        self.ssl_refresher: SSLCertRefresher | None = None
        self._refresh_task: asyncio.Task | None = None

    async def startup(self, sockets: Any = None) -> None:
        await super().startup(sockets)
        config = self.config
        if self.ssl_refresh and config.ssl is not None:
            self.ssl_refresher = SSLCertRefresher(
                config.ssl, config.ssl_certfile, config.ssl_keyfile, config.ssl_ca_certs
            )
            self._refresh_task = asyncio.create_task(self.ssl_refresher.run())

    async def shutdown(self, sockets: Any = None) -> None:
        grace_s = self.config.timeout_graceful_shutdown
        handle = None
        if grace_s is not None:
            handle = asyncio.get_running_loop().call_later(
                max(grace_s - SHUTDOWN_MARGIN_S, 0.0),
                self.async_engine.end_all,
                "The server is shutting down.",
            )
        if self._refresh_task is not None:
            self._refresh_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._refresh_task
        try:
            await super().shutdown(sockets)
        finally:
            if handle is not None:
                handle.cancel()
            if self.access_log_filter is not None:
                logging.getLogger(ACCESS_LOGGER).removeFilter(self.access_log_filter)


def make_server(
    app: Any, async_engine: AsyncEngine, config: Any, log_level: str = "info"
) -> Server:
    """The server for `app` with the limits of `config` (a ServerConfig)."""
    protocol = type(
        "OctavoH11Protocol",
        (HeadTimeoutH11Protocol,),
        {"header_read_timeout_s": config.header_read_timeout_s},
    )
    return Server(
        uvicorn.Config(
            app,
            host=config.host,
            port=config.port,
            # uvicorn binds the socket file instead of host and port when it is set.
            uds=config.uds,
            log_level=config.uvicorn_log_level or log_level,
            access_log=not config.disable_uvicorn_access_log,
            ssl_keyfile=config.ssl_keyfile,
            ssl_certfile=config.ssl_certfile,
            ssl_ca_certs=config.ssl_ca_certs,
            ssl_cert_reqs=config.ssl_cert_reqs,
            **({"ssl_ciphers": config.ssl_ciphers} if config.ssl_ciphers else {}),
            http=protocol,
            timeout_keep_alive=config.timeout_keep_alive_s,
            limit_concurrency=config.limit_concurrency,
            timeout_graceful_shutdown=config.shutdown_timeout_s,
        ),
        async_engine,
        ssl_refresh=config.enable_ssl_refresh,
        access_log_filter=(
            AccessLogFilter(paths) if (paths := config.disable_access_log_for_endpoints) else None
        ),
    )
