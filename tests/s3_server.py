"""A real S3 API on localhost for the remote-data tests: moto's server mode on a free loopback port, a fault
proxy in front of it that fails a bounded number of requests (HTTP 503, or a dropped connection), counts requests and
bytes and can add a delay to each (the benchmark's), and a plain HTTP server with byte ranges (`https://` data)."""

from __future__ import annotations

import http.client
import http.server
import logging
import os
import socket
import threading
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager

import pytest

pytest.importorskip("moto.server")
pytest.importorskip("s3fs")
from moto.server import ThreadedMotoServer  # noqa: E402


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextmanager
def s3_server() -> Iterator[str]:
    """A moto S3 server on 127.0.0.1; yields its endpoint URL."""
    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.stop()


def s3_environment(endpoint: str) -> dict[str, str]:
    """What a process needs to reach the server the way botocore reads it (`AWS_ENDPOINT_URL`)."""
    return {"AWS_ENDPOINT_URL": endpoint, "AWS_ACCESS_KEY_ID": "test", "AWS_SECRET_ACCESS_KEY": "test",
            "AWS_DEFAULT_REGION": "us-east-1"}


def upload(local_dir: str, bucket_url: str) -> None:
    """Copy every file of `local_dir` to `bucket_url` ("s3://bucket/prefix"), creating the bucket."""
    import s3fs

    fs = s3fs.S3FileSystem(skip_instance_cache=True)
    bucket = bucket_url.split("://", 1)[1].split("/", 1)[0]
    if not fs.exists(bucket):
        fs.mkdir(bucket)
    for name in sorted(os.listdir(local_dir)):
        path = os.path.join(local_dir, name)
        if os.path.isfile(path):
            fs.put_file(path, f"{bucket_url}/{name}")


class FaultProxy:
    """An HTTP proxy on loopback that forwards to `upstream` and fails every `every`-th GET or HEAD (503 SlowDown,
    500 InternalError, or a connection dropped half-way through the body, in turn; with `throttle`, always that
    status: 503 SlowDown or 429), at most `limit` times: a flaky object store. `delay_s`: added before each answer (a
    store's latency). `counts`: requests by (method, path without the query); `bytes_sent`: response bodies' bytes."""

    def __init__(self, upstream: str, every: int = 10**9, limit: int = 0, down: str | None = None,
                 throttle: int | None = None, delay_s: float = 0.0) -> None:
        self.upstream = upstream.split("://", 1)[1]
        self.every, self.limit, self.failed, self.requests = every, limit, 0, 0
        self.down = down  # requests whose path holds this always fail (503): an object that stays unreachable
        self.throttle, self.delay_s = throttle, delay_s
        self.counts: Counter = Counter()
        self.bytes_sent = 0
        self.lock = threading.Lock()
        proxy = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: object) -> None:
                pass

            def _forward(self) -> None:
                if proxy.delay_s:
                    time.sleep(proxy.delay_s)
                with proxy.lock:
                    proxy.requests += 1
                    proxy.counts[self.command, self.path.split("?", 1)[0]] += 1
                    fail = (self.command in ("GET", "HEAD") and proxy.failed < proxy.limit
                            and proxy.requests % proxy.every == 0)
                    proxy.failed += fail
                    kind = proxy.failed % 3
                    if proxy.down is not None and proxy.down in self.path:
                        fail, kind = True, 1
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                if fail and proxy.throttle is not None:
                    kind = 1
                if fail and kind != 0:
                    code, status = ("SlowDown", 503) if kind == 1 else ("InternalError", 500)
                    if proxy.throttle == 429:
                        code, status = "TooManyRequests", 429
                    message = f"<Error><Code>{code}</Code><Message>injected</Message></Error>".encode()
                    self.send_response(status)
                    self.send_header("Content-Length", str(len(message)))
                    self.end_headers()
                    if self.command != "HEAD":
                        self.wfile.write(message)
                    return
                conn = http.client.HTTPConnection(proxy.upstream, timeout=30)
                conn.request(self.command, self.path, body=body or None, headers=dict(self.headers))
                response = conn.getresponse()
                data = response.read()
                self.send_response(response.status)
                head = self.command == "HEAD"  # its Content-Length is the object's, with no body
                skip = ("transfer-encoding", "connection") if head else ("transfer-encoding", "connection",
                                                                          "content-length")
                for key, value in response.getheaders():
                    if key.lower() not in skip:
                        self.send_header(key, value)
                if not head:
                    self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                if fail:  # the connection drops half-way through the body
                    self.wfile.write(data[: len(data) // 2])
                    self.wfile.flush()
                    self.close_connection = True
                    self.connection.shutdown(socket.SHUT_RDWR)
                elif self.command != "HEAD":
                    self.wfile.write(data)
                    with proxy.lock:
                        proxy.bytes_sent += len(data)
                conn.close()

            do_GET = do_HEAD = do_PUT = do_POST = do_DELETE = _forward

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def __enter__(self) -> FaultProxy:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


class RangeServer:
    """A plain HTTP server on loopback serving the files of `folder`, with single byte ranges (`Range: bytes=a-b`,
    206) and HEAD, as a CDN or a file server gives `https://` data; no listing. `counts`: requests by (method,
    path)."""

    def __init__(self, folder: str) -> None:
        self.counts: Counter = Counter()
        server = self

        class Handler(http.server.SimpleHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def __init__(self, *args: object, **kwargs: object) -> None:
                super().__init__(*args, directory=folder, **kwargs)

            def log_message(self, *args: object) -> None:
                pass

            def do_HEAD(self) -> None:
                self._answer(body=False)

            def do_GET(self) -> None:
                self._answer(body=True)

            def _answer(self, body: bool) -> None:
                server.counts[self.command, self.path] += 1
                path = self.translate_path(self.path)
                if not os.path.isfile(path):
                    self.send_error(404)
                    return
                with open(path, "rb") as f:
                    data = f.read()
                start, end, status = 0, len(data), 200
                wanted = self.headers.get("Range")
                if wanted and wanted.startswith("bytes="):
                    first, _, last = wanted[6:].partition("-")
                    start, end, status = int(first), min(len(data), int(last) + 1 if last else len(data)), 206
                self.send_response(status)
                self.send_header("Content-Length", str(end - start))
                self.send_header("Accept-Ranges", "bytes")
                self.send_header("ETag", f'"{os.stat(path).st_mtime_ns}-{len(data)}"')
                if status == 206:
                    self.send_header("Content-Range", f"bytes {start}-{end - 1}/{len(data)}")
                self.end_headers()
                if body:
                    self.wfile.write(data[start:end])

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def __enter__(self) -> RangeServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()
