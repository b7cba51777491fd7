"""moto's S3 server on loopback, and an HTTP proxy in front of it that counts and breaks.

The proxy forwards every request to the server and counts, per object, the requests, the
body bytes of ``GET`` answers and of ``PUT`` requests: what a client really fetched and sent,
not what it says it did.
Faults can be injected on requests whose path contains a string: a connection reset, a
``500`` / ``503 SlowDown`` answer, a stalled answer, or a body cut short; or requests merely
delayed (a slow server, so that a test can catch a client in the middle of its writes). It
also counts, per object, the most parts of a multipart upload on the wire at once. The tests
of range reads and of streamed writes, the lost-worker tests on S3 and ``bench/bench_remote.py``
use it.
"""

from __future__ import annotations

import contextlib
import http.client
import logging
import os
import socket
import socketserver
import struct
import threading
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

CREDENTIALS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1",
               "AWS_EC2_METADATA_DISABLED": "true"}

ERRORS = {
    "500": (500, "InternalError", "We encountered an internal error. Please try again."),
    "503": (503, "ServiceUnavailable", "Service is unable to handle request."),
    "slowdown": (503, "SlowDown", "Please reduce your request rate."),
}


@contextlib.contextmanager
def moto_server(*, endpoint_in_env: bool = False) -> Iterator[str]:
    """moto's S3 server on a free loopback port (its endpoint), credentials in the environment
    (with ``endpoint_in_env`` the endpoint too, as ``AWS_ENDPOINT_URL``)."""
    from moto.server import ThreadedMotoServer  # (only the S3 tests start it)

    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    env = {**CREDENTIALS, **({"AWS_ENDPOINT_URL": f"http://{host}:{port}"} if endpoint_in_env else {})}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield f"http://{host}:{port}"
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        server.stop()


@contextlib.contextmanager
def proxied_bucket(bucket: str) -> Iterator[tuple[Any, Proxy]]:
    """moto's server with ``bucket``, an s3fs client of the server itself (to set up and look),
    and the proxy in front of it (what zckpt talks to)."""
    import s3fs  # (only the S3 tests use it)

    with moto_server() as endpoint, Proxy(endpoint) as proxy:
        fs = s3fs.S3FileSystem(endpoint_url=endpoint, skip_instance_cache=True)
        fs.mkdir(bucket)
        yield fs, proxy


@dataclass
class Fault:
    """``kind`` (``reset``, ``500``, ``503``, ``slowdown``, ``stall``, ``short``, or ``delay``:
    answered after ``stall_seconds``) on the next ``times`` requests (``GET`` by default) whose
    path contains ``where``."""

    where: str
    kind: str
    times: int = 1_000_000
    method: str = "GET"
    stall_seconds: float = 5.0
    min_length: int = 0
    """Only ranged requests at least this long (payloads, not the header walk's blocks)."""
    query: str = ""
    """Only requests whose query string contains this (``partNumber=3``: one part of an upload)."""


class Proxy:
    """A counting, fault-injecting HTTP proxy to ``upstream`` (use as a context manager)."""

    def __init__(self, upstream: str) -> None:
        self.upstream = urlsplit(upstream)
        self.faults: list[Fault] = []
        self.requests: Counter[str] = Counter()
        self.body_bytes: Counter[str] = Counter()
        self.injected: Counter[str] = Counter()
        self.uploaded: Counter[str] = Counter()
        """Body bytes of ``PUT`` requests per object (a whole object or a part of an upload)."""
        self.ranges: list[tuple[str, int, int]] = []
        """``(object path, start, stop)`` of every ranged ``GET`` answered (a benchmark replays them)."""
        self.parts_at_once: Counter[str] = Counter()
        """The most ``PUT``s of parts of an object's multipart upload received and not yet answered."""
        self._parts_now: Counter[str] = Counter()
        self._lock = threading.Lock()
        proxy = self

        class Handler(socketserver.StreamRequestHandler):
            def handle(self) -> None:
                with contextlib.suppress(OSError, http.client.HTTPException):
                    while proxy._one(self):
                        pass

        class Server(socketserver.ThreadingTCPServer):
            daemon_threads = True
            allow_reuse_address = True

        self._server = Server(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    def __enter__(self) -> Proxy:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.shutdown()
        self._server.server_close()

    def reset_counts(self) -> None:
        with self._lock:
            self.requests.clear()
            self.body_bytes.clear()
            self.injected.clear()
            self.uploaded.clear()
            self.ranges.clear()
            self.parts_at_once.clear()

    def fetched(self, where: str = "") -> int:
        """Body bytes of ``GET`` answers for objects whose path contains ``where``."""
        with self._lock:
            return sum(n for p, n in self.body_bytes.items() if where in p)

    def writes(self, where: str = "") -> list[str]:
        """``PUT`` and ``POST`` requests (whole objects, multipart parts) to paths containing
        ``where``, as ``"METHOD path"``: counted when they arrive, before they are answered."""
        with self._lock:
            return [k for k in self.requests if k.split(" ", 1)[0] in ("PUT", "POST") and where in k]

    def options(self, **extra: Any) -> dict[str, Any]:
        """s3fs options that reach the server through this proxy, with the client's own retries
        off (so that zckpt's are the ones tried) and a short read timeout (a stall is seen)."""
        return {"endpoint_url": self.url,
                "config_kwargs": {"retries": {"total_max_attempts": 1}, "read_timeout": 2, "connect_timeout": 2},
                **extra}

    def _fault(self, method: str, path: str, query: str, length: int) -> Fault | None:
        with self._lock:
            for f in self.faults:
                if f.times > 0 and f.method == method and f.where in path and f.query in query \
                        and length >= f.min_length:
                    f.times -= 1
                    self.injected[f.kind] += 1
                    return f
        return None

    def _one(self, h: socketserver.StreamRequestHandler) -> bool:
        line = h.rfile.readline(65537)
        if not line.strip():
            return False
        method, target, _ = line.decode("latin-1").split(" ", 2)
        headers: list[tuple[str, str]] = []
        while True:
            raw = h.rfile.readline(65537).decode("latin-1")
            if raw in ("\r\n", "\n", ""):
                break
            k, v = raw.split(":", 1)
            headers.append((k.strip(), v.strip()))
        hmap = {k.lower(): v for k, v in headers}
        if hmap.get("expect", "").lower() == "100-continue":  # answered here: the server gets the body at once
            h.wfile.write(b"HTTP/1.1 100 Continue\r\n\r\n")
            h.wfile.flush()
            headers = [(k, v) for k, v in headers if k.lower() != "expect"]
        body = b""
        if "content-length" in hmap:
            body = h.rfile.read(int(hmap["content-length"]))
        elif hmap.get("transfer-encoding", "").lower() == "chunked":
            body = _read_chunked(h.rfile)
            headers = [(k, v) for k, v in headers if k.lower() != "transfer-encoding"]
            headers.append(("Content-Length", str(len(body))))
        path, _, query = target.partition("?")
        obj = "?" not in target or "list-type" not in target
        part = method == "PUT" and "partNumber=" in query
        with self._lock:
            self.requests[f"{method} {path}"] += 1
            if method == "PUT":
                self.uploaded[path] += len(body)
            if part:
                self._parts_now[path] += 1
                self.parts_at_once[path] = max(self.parts_at_once[path], self._parts_now[path])
        try:
            return self._answer(h, method, target, path, query, obj, headers, hmap, body)
        finally:
            if part:
                with self._lock:
                    self._parts_now[path] -= 1

    def _answer(self, h: socketserver.StreamRequestHandler, method: str, target: str, path: str, query: str,
                obj: bool, headers: list[tuple[str, str]], hmap: dict[str, str], body: bytes) -> bool:
        fault = self._fault(method, path, query, _range_length(hmap.get("range", "")))
        if fault is not None and fault.kind == "reset":
            h.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            return False
        if fault is not None and fault.kind in ERRORS:
            status, code, message = ERRORS[fault.kind]
            xml = (f"<?xml version=\"1.0\" encoding=\"UTF-8\"?><Error><Code>{code}</Code><Message>{message}</Message>"
                   f"<Resource>{path}</Resource><RequestId>1</RequestId></Error>").encode()
            h.wfile.write(f"HTTP/1.1 {status} Error\r\nContent-Type: application/xml\r\nContent-Length: {len(xml)}"
                          "\r\n\r\n".encode() + xml)
            h.wfile.flush()
            return True
        if fault is not None and fault.kind in ("stall", "delay"):
            time.sleep(fault.stall_seconds)
            if fault.kind == "stall":
                return False
        conn = http.client.HTTPConnection(self.upstream.hostname, self.upstream.port, timeout=60)
        try:
            conn.putrequest(method, target, skip_host=True, skip_accept_encoding=True)
            for k, v in headers:
                conn.putheader(k, v)
            conn.endheaders(body or None)
            resp = conn.getresponse()
            data = resp.read()
            out_headers = [(k, v) for k, v in resp.getheaders()
                           if k.lower() not in ("transfer-encoding", "content-length", "connection")]
            status, reason = resp.status, resp.reason
        finally:
            conn.close()
        if method == "GET" and obj and path.count("/") >= 2:
            with self._lock:
                self.body_bytes[path] += len(data)
                asked = hmap.get("range", "")
                first = asked[6:].split("-", 1)[0]
                if asked.startswith("bytes=") and status == 206 and first.isdigit():  # not a suffix ("bytes=-n")
                    self.ranges.append((path, int(first), int(first) + len(data)))
        head = f"HTTP/1.1 {status} {reason}\r\n" + "".join(f"{k}: {v}\r\n" for k, v in out_headers)
        length = resp.getheader("Content-Length", "0") if method == "HEAD" else str(len(data))
        head += f"Content-Length: {length}\r\n\r\n"
        if fault is not None and fault.kind == "short":
            h.wfile.write(head.encode("latin-1") + data[: len(data) // 2])
            h.wfile.flush()
            return False
        h.wfile.write(head.encode("latin-1") + (data if method != "HEAD" else b""))
        h.wfile.flush()
        return True


def _range_length(header: str) -> int:
    """Bytes a ``Range: bytes=a-b`` header asks for (a huge number when it asks for all)."""
    if not header.startswith("bytes=") or "-" not in header:
        return 1 << 62
    a, b = header[6:].split("-", 1)
    return int(b) - int(a) + 1 if a and b else 1 << 62


def _read_chunked(f: Any) -> bytes:
    out = bytearray()
    while True:
        size = int(f.readline().split(b";", 1)[0].strip() or b"0", 16)
        if size == 0:
            while f.readline() not in (b"\r\n", b"\n", b""):
                pass
            return bytes(out)
        out += f.read(size)
        f.readline()
