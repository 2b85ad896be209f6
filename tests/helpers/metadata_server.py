"""Fake cloud metadata services (AWS IMDSv2, GCP, Azure IMDS) on 127.0.0.1, for tests.

Each server speaks the part of its provider's protocol that the preemption watcher and the
provider detection use, including the parts that reject careless clients:

- aws: ``PUT /latest/api/token`` needs ``X-aws-ec2-metadata-token-ttl-seconds`` (1..21600), and
  every ``GET /latest/...`` without a valid ``X-aws-ec2-metadata-token`` is answered 401.
  ``/latest/meta-data/spot/instance-action`` is 404 until :meth:`FakeMetadataServer.announce`.
- gcp: every request needs ``Metadata-Flavor: Google`` (else 403); every answer carries it.
  ``/computeMetadata/v1/instance/preempted`` is ``FALSE`` until announced, then ``TRUE``.
- azure: every request needs ``Metadata: true`` and an ``api-version`` query (else 400).
  ``/metadata/scheduledevents`` lists no events until announced.

Usage::

    with FakeMetadataServer("aws") as srv:
        watcher = PreemptionWatcher("aws", srv.base_url, poll_s=0.1, on_notice=...)
        srv.announce(action="terminate")
"""

from __future__ import annotations

import json
import secrets
import threading
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from email.utils import formatdate
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlsplit

PROVIDERS = ("aws", "gcp", "azure")
AWS_ACTIONS = ("terminate", "stop", "hibernate")


@dataclass(frozen=True)
class RecordedRequest:
    method: str
    path: str  # with the query string
    headers: dict[str, str]  # names lower-cased (HTTP header names are case-insensitive)


class FakeMetadataServer:
    """A metadata service for ``provider`` on 127.0.0.1 (a free port), on a daemon thread."""

    def __init__(self, provider: str, *, vm_name: str = "fake-vm") -> None:
        if provider not in PROVIDERS:
            raise ValueError(f"provider {provider!r} is unknown; use one of {PROVIDERS}")
        self.provider = provider
        self.vm_name = vm_name
        self.requests: list[RecordedRequest] = []
        self._lock = threading.Lock()
        self._notice: dict[str, Any] | None = None
        self._tokens: dict[str, float] = {}  # aws token -> expiry (monotonic)
        self._failure: int | None = None
        self._incarnation = 1
        self._server: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None

    # -- lifecycle ----------------------------------------------------------------------------

    def start(self) -> FakeMetadataServer:
        handler = type("Handler", (_Handler,), {"fake": self})
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(
            target=self._server.serve_forever,
            kwargs={"poll_interval": 0.05},
            daemon=True,
            name=f"fake-metadata-{self.provider}",
        )
        self._thread.start()
        return self

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
        if self._thread is not None:
            self._thread.join(5)
            self._thread = None

    def __enter__(self) -> FakeMetadataServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def port(self) -> int:
        if self._server is None:
            raise RuntimeError("the fake metadata server is not started; use it as a context")
        return int(self._server.server_address[1])

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    # -- scenario controls --------------------------------------------------------------------

    def announce(
        self,
        action: str | None = None,
        *,
        deadline: float | None = None,
        resources: list[str] | None = None,
    ) -> None:
        """Start answering with a preemption notice.

        ``action``: aws ``terminate`` (default) / ``stop`` / ``hibernate``; azure the EventType,
        ``Preempt`` (default) or any other (``Terminate``, ``Freeze``, ``Reboot``, ...); gcp
        takes none. ``deadline``: Unix seconds (default: now + the provider's usual notice).
        ``resources`` (azure): the VMs the event is for (default: this VM).
        """
        now = time.time()
        if self.provider == "aws":
            action = action or "terminate"
            if action not in AWS_ACTIONS:
                raise ValueError(f"aws action {action!r} is not one of {AWS_ACTIONS}")
            when = datetime.fromtimestamp(deadline or now + 120, UTC)
            notice: dict[str, Any] = {
                "action": action,
                "time": when.strftime("%Y-%m-%dT%H:%M:%SZ"),
            }
        elif self.provider == "gcp":
            if action not in (None, "preempt"):
                raise ValueError(f"gcp has one notice (preempted); action {action!r} is invalid")
            notice = {"preempted": True}
        else:
            notice = {
                "EventId": secrets.token_hex(8),
                "EventStatus": "Scheduled",
                "EventType": action or "Preempt",
                "ResourceType": "VirtualMachine",
                "Resources": [self.vm_name] if resources is None else list(resources),
                "NotBefore": formatdate(deadline or now + 30, usegmt=True),
                "Description": "fake eviction",
                "EventSource": "Platform",
                "DurationInSeconds": -1,
            }
        with self._lock:
            self._notice = notice
            self._incarnation += 1

    def clear(self) -> None:
        """Withdraw the notice."""
        with self._lock:
            self._notice = None
            self._incarnation += 1

    def expire_tokens(self) -> None:
        """aws: every token issued so far stops working (the client must fetch a new one)."""
        with self._lock:
            self._tokens.clear()

    def fail(self, status: int = 500) -> None:
        """Answer every request with ``status`` until :meth:`recover`."""
        with self._lock:
            self._failure = status

    def recover(self) -> None:
        with self._lock:
            self._failure = None

    def count(self, method: str, path_prefix: str) -> int:
        """How many recorded requests had this method and a path starting with the prefix."""
        with self._lock:
            return sum(
                1 for r in self.requests if r.method == method and r.path.startswith(path_prefix)
            )


class _Handler(BaseHTTPRequestHandler):
    fake: FakeMetadataServer
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: Any) -> None:
        pass  # keep test output clean

    def _reply(
        self, status: int, body: str | bytes = b"", content_type: str = "text/plain"
    ) -> None:
        data = body.encode() if isinstance(body, str) else body
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(data)))
        if self.fake.provider == "gcp":
            self.send_header("Metadata-Flavor", "Google")
        self.end_headers()
        self.wfile.write(data)

    def _handle(self, method: str) -> None:
        fake = self.fake
        with fake._lock:
            fake.requests.append(
                RecordedRequest(method, self.path, {k.lower(): v for k, v in self.headers.items()})
            )
            failure = fake._failure
        length = int(self.headers.get("Content-Length") or 0)
        if length:
            self.rfile.read(length)
        if failure is not None:
            self._reply(failure, f"fake outage: HTTP {failure}")
            return
        url = urlsplit(self.path)
        getattr(self, f"_{fake.provider}")(method, url.path, parse_qs(url.query))

    def do_GET(self) -> None:
        self._handle("GET")

    def do_PUT(self) -> None:
        self._handle("PUT")

    # -- providers ----------------------------------------------------------------------------

    def _aws(self, method: str, path: str, query: dict[str, list[str]]) -> None:
        fake = self.fake
        if path == "/latest/api/token":
            if method != "PUT":
                self._reply(405, "the token is requested with PUT")
                return
            ttl = self.headers.get("X-aws-ec2-metadata-token-ttl-seconds", "")
            if not ttl.isdigit() or not 1 <= int(ttl) <= 21600:
                self._reply(400, "X-aws-ec2-metadata-token-ttl-seconds must be 1..21600")
                return
            token = secrets.token_urlsafe(24)
            with fake._lock:
                fake._tokens[token] = time.monotonic() + int(ttl)
            self._reply(200, token)
            return
        if not path.startswith("/latest/"):
            self._reply(404, "Not Found")
            return
        token = self.headers.get("X-aws-ec2-metadata-token", "")
        with fake._lock:
            valid = fake._tokens.get(token, 0.0) > time.monotonic()
            notice = fake._notice
        if method != "GET":
            self._reply(405, "")
        elif not valid:
            self._reply(401, "")
        elif path == "/latest/meta-data/instance-id":
            self._reply(200, "i-0fake0000000000000")
        elif path == "/latest/meta-data/spot/instance-action" and notice is not None:
            self._reply(200, json.dumps(notice), "application/json")
        else:
            self._reply(404, "Not Found")

    def _gcp(self, method: str, path: str, query: dict[str, list[str]]) -> None:
        if self.headers.get("Metadata-Flavor") != "Google":
            self._reply(403, "Missing Metadata-Flavor:Google header.")
            return
        with self.fake._lock:
            preempted = self.fake._notice is not None
        if method != "GET":
            self._reply(405, "")
        elif path == "/computeMetadata/v1/":
            self._reply(200, "instance/\nproject/\n")
        elif path == "/computeMetadata/v1/instance/id":
            self._reply(200, "1234567890123456789")
        elif path == "/computeMetadata/v1/instance/preempted":
            self._reply(200, "TRUE" if preempted else "FALSE")
        else:
            self._reply(404, "Not Found")

    def _azure(self, method: str, path: str, query: dict[str, list[str]]) -> None:
        fake = self.fake
        if self.headers.get("Metadata") != "true":
            self._reply(
                400,
                json.dumps({"error": "Bad request. Required metadata header not specified"}),
                "application/json",
            )
            return
        if "api-version" not in query:
            self._reply(
                400,
                json.dumps({"error": "Bad request. api-version was not specified"}),
                "application/json",
            )
            return
        with fake._lock:
            notice, incarnation = fake._notice, fake._incarnation
        if method != "GET":
            self._reply(405, "")
        elif path == "/metadata/instance":
            compute = {"name": fake.vm_name, "azEnvironment": "AzurePublicCloud", "vmId": "0000"}
            self._reply(200, json.dumps({"compute": compute}), "application/json")
        elif path == "/metadata/instance/compute/name":
            self._reply(200, fake.vm_name)
        elif path == "/metadata/scheduledevents":
            doc = {"DocumentIncarnation": incarnation, "Events": [notice] if notice else []}
            self._reply(200, json.dumps(doc), "application/json")
        else:
            self._reply(404, "Not Found")
