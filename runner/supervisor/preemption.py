"""Cloud spot/preemption notice watchers: AWS, GCP and Azure instance metadata services.

A spot VM gets a short warning before it is taken away (AWS about 2 minutes, GCP about 30 s,
Azure at least 30 s). The supervisor runs a :class:`PreemptionWatcher`, whose daemon thread polls
the provider's metadata endpoint and calls ``on_notice`` once, so the worker can save a
checkpoint and the supervisor can exit 75 ("preempted, reschedule me").

Protocols:

- AWS (IMDSv2): ``PUT /latest/api/token`` with ``X-aws-ec2-metadata-token-ttl-seconds``, then
  ``GET /latest/meta-data/spot/instance-action`` with ``X-aws-ec2-metadata-token``; 404 means no
  notice, 200 carries ``{"action": "terminate"|"stop"|"hibernate", "time": "<ISO 8601>"}``.
- GCP: ``GET /computeMetadata/v1/instance/preempted`` with ``Metadata-Flavor: Google``; the body
  is ``TRUE`` once the VM is being preempted.
- Azure: ``GET /metadata/scheduledevents?api-version=2020-07-01`` with ``Metadata: true``; an
  event of type ``Preempt`` (spot eviction) or ``Terminate`` that names this VM is a notice.

Requests use only the standard library, never a proxy, 1 s for the whole exchange (however
slowly an answer trickles in) and no retries: a poll that fails is logged (at most once a
minute) and the next poll tries again. Nothing here raises
into the supervisor once a watcher is constructed.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import logging
import socket
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from email.utils import parsedate_to_datetime
from typing import Any, ClassVar

from m3run.runner.supervisor.save_budget import GCP_NOTICE_S, SaveBudget

log = logging.getLogger(__name__)

PROVIDERS = ("aws", "gcp", "azure")
DEFAULT_BASE_URLS: dict[str, str] = {
    "aws": "http://169.254.169.254",
    "gcp": "http://metadata.google.internal",
    "azure": "http://169.254.169.254",
}
REQUEST_TIMEOUT_S = 1.0
ERROR_LOG_INTERVAL_S = 60.0
AWS_TOKEN_TTL_S = 21600  # the IMDSv2 maximum; a fresh token is fetched well before it expires
AZURE_NOTICE_TYPES = ("Preempt", "Terminate")


class _Exchange:
    """One request's socket, shut down at the request's deadline. A socket timeout bounds each
    recv only: a server that trickles its answer a byte a second keeps every recv short and the
    watcher in read() for as long as it likes. Shutting the socket down wakes any blocked recv,
    whichever part of the answer it is reading."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._sock: socket.socket | None = None
        self.cut = False

    def attach(self, sock: socket.socket) -> None:
        with self._lock:
            self._sock = sock
            if self.cut:
                self._shut()

    def cut_off(self) -> None:
        with self._lock:
            self.cut = True
            self._shut()

    def _shut(self) -> None:
        if self._sock is not None:
            with contextlib.suppress(OSError):
                self._sock.shutdown(socket.SHUT_RDWR)


# The exchange of the request this thread is making; its connection attaches its socket.
_current = threading.local()


class _BoundedConnection(http.client.HTTPConnection):
    def connect(self) -> None:
        super().connect()
        exchange = getattr(_current, "exchange", None)
        if exchange is not None:
            exchange.attach(self.sock)


class _BoundedHTTPHandler(urllib.request.HTTPHandler):
    def http_open(self, req: urllib.request.Request) -> http.client.HTTPResponse:
        return self.do_open(_BoundedConnection, req)


# Metadata services are link-local; an http_proxy from the environment must never see them.
_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}), _BoundedHTTPHandler)


@dataclass(frozen=True)
class Notice:
    """A preemption notice.

    ``action``: AWS ``terminate``/``stop``/``hibernate``, GCP ``preempt``, Azure ``preempt`` or
    ``terminate``. ``deadline``: when the VM goes away, in Unix seconds, or None if unknown.
    ``raw``: the provider's answer (the parsed JSON document or event, or the body text).
    """

    provider: str
    action: str
    deadline: float | None
    raw: Any

    def seconds_left(self, now: float | None = None) -> float | None:
        if self.deadline is None:
            return None
        return self.deadline - (time.time() if now is None else now)


class MetadataError(RuntimeError):
    """A metadata endpoint could not be reached or gave an answer outside its protocol."""


def _request(
    method: str,
    url: str,
    headers: Mapping[str, str],
    timeout_s: float,
) -> tuple[int, http.client.HTTPMessage, bytes]:
    """One HTTP exchange, all of it (connect, headers, body) within ``timeout_s``; HTTP error
    statuses are returned, transport failures and a deadline passed raise."""
    data = b"" if method == "PUT" else None
    req = urllib.request.Request(url, data=data, headers=dict(headers), method=method)
    exchange = _Exchange()
    timer = threading.Timer(timeout_s, exchange.cut_off)
    timer.daemon = True
    _current.exchange = exchange
    timer.start()
    try:
        with _OPENER.open(req, timeout=timeout_s) as resp:
            return resp.status, resp.headers, resp.read()
    except urllib.error.HTTPError as err:
        try:
            return err.code, err.headers, err.read()
        except (OSError, http.client.HTTPException) as read_err:
            raise MetadataError(_failed(method, url, read_err, exchange, timeout_s)) from read_err
        finally:
            err.close()
    except (OSError, http.client.HTTPException, ValueError) as err:
        raise MetadataError(_failed(method, url, err, exchange, timeout_s)) from err
    finally:
        timer.cancel()
        _current.exchange = None


def _failed(
    method: str, url: str, err: BaseException, exchange: _Exchange, timeout_s: float
) -> str:
    if exchange.cut:
        return f"{method} {url} failed: no complete answer within {timeout_s:g}s"
    return f"{method} {url} failed: {getattr(err, 'reason', err)}"


def _parse_iso(text: Any) -> float | None:
    if not isinstance(text, str):
        return None
    try:
        return datetime.fromisoformat(text).timestamp()
    except ValueError:
        return None


def _parse_http_date(text: Any) -> float | None:
    if not isinstance(text, str) or not text:
        return None
    try:
        return parsedate_to_datetime(text).timestamp()
    except (TypeError, ValueError):
        return None


class _Aws:
    provider = "aws"

    def __init__(self, base_url: str) -> None:
        self.base_url = base_url.rstrip("/")
        self._token: str | None = None
        self._token_expires = 0.0

    def _fetch_token(self, timeout_s: float) -> str:
        url = f"{self.base_url}/latest/api/token"
        try:
            status, _, body = _request(
                "PUT",
                url,
                {"X-aws-ec2-metadata-token-ttl-seconds": str(AWS_TOKEN_TTL_S)},
                timeout_s,
            )
        except MetadataError as err:
            raise MetadataError(
                f"{err}. Fix: inside a container the IMDSv2 token reply needs a hop limit of 2 "
                f"(aws ec2 modify-instance-metadata-options --http-put-response-hop-limit 2)."
            ) from err
        if status != 200 or not body.strip():
            raise MetadataError(f"PUT {url} answered HTTP {status}; expected an IMDSv2 token")
        self._token = body.decode().strip()
        # Refresh at half life: a token that expires between polls costs a 401 round trip.
        self._token_expires = time.monotonic() + AWS_TOKEN_TTL_S / 2
        return self._token

    def _get(self, path: str, timeout_s: float) -> tuple[int, bytes]:
        token = self._token
        if token is None or time.monotonic() >= self._token_expires:
            token = self._fetch_token(timeout_s)
        url = f"{self.base_url}{path}"
        status, _, body = _request("GET", url, {"X-aws-ec2-metadata-token": token}, timeout_s)
        if status == 401:  # the token expired or the instance metadata was reset
            token = self._fetch_token(timeout_s)
            status, _, body = _request("GET", url, {"X-aws-ec2-metadata-token": token}, timeout_s)
        return status, body

    def check(self, timeout_s: float) -> Notice | None:
        path = "/latest/meta-data/spot/instance-action"
        status, body = self._get(path, timeout_s)
        if status == 404:
            return None
        if status != 200:
            raise MetadataError(f"GET {self.base_url}{path} answered HTTP {status}")
        try:
            doc = json.loads(body)
            action = str(doc["action"])
        except (ValueError, KeyError, TypeError) as err:
            raise MetadataError(
                f"GET {self.base_url}{path} gave no instance action document: {body[:200]!r}"
            ) from err
        return Notice("aws", action, _parse_iso(doc.get("time")), doc)

    def identify(self, timeout_s: float) -> bool:
        status, headers, body = _request(
            "PUT",
            f"{self.base_url}/latest/api/token",
            {"X-aws-ec2-metadata-token-ttl-seconds": "60"},
            timeout_s,
        )
        if status != 200 or not body.strip() or headers.get("Metadata-Flavor"):
            return False
        status, _, body = _request(
            "GET",
            f"{self.base_url}/latest/meta-data/instance-id",
            {"X-aws-ec2-metadata-token": body.decode().strip()},
            timeout_s,
        )
        return status == 200 and body.startswith(b"i-")


class _Gcp:
    provider = "gcp"
    headers: ClassVar[dict[str, str]] = {"Metadata-Flavor": "Google"}

    def __init__(self, base_url: str) -> None:
        self.base_url = base_url.rstrip("/")

    def check(self, timeout_s: float) -> Notice | None:
        url = f"{self.base_url}/computeMetadata/v1/instance/preempted"
        status, _, body = _request("GET", url, self.headers, timeout_s)
        if status != 200:
            raise MetadataError(f"GET {url} answered HTTP {status}")
        text = body.decode(errors="replace").strip()
        if text.upper() != "TRUE":
            return None
        return Notice("gcp", "preempt", time.time() + GCP_NOTICE_S, text)

    def identify(self, timeout_s: float) -> bool:
        status, headers, _ = _request(
            "GET", f"{self.base_url}/computeMetadata/v1/", self.headers, timeout_s
        )
        return status == 200 and headers.get("Metadata-Flavor") == "Google"


class _Azure:
    provider = "azure"
    headers: ClassVar[dict[str, str]] = {"Metadata": "true"}

    def __init__(self, base_url: str) -> None:
        self.base_url = base_url.rstrip("/")
        self._vm_name: str | None = None

    def _own_name(self, timeout_s: float) -> str | None:
        """This VM's name, which scheduled events list in ``Resources``; None if unknown."""
        if self._vm_name is None:
            url = (
                f"{self.base_url}/metadata/instance/compute/name?api-version=2021-02-01&format=text"
            )
            try:
                status, _, body = _request("GET", url, self.headers, timeout_s)
            except MetadataError:
                return None
            if status == 200 and body.strip():
                self._vm_name = body.decode(errors="replace").strip()
        return self._vm_name

    def check(self, timeout_s: float) -> Notice | None:
        url = f"{self.base_url}/metadata/scheduledevents?api-version=2020-07-01"
        status, _, body = _request("GET", url, self.headers, timeout_s)
        if status != 200:
            raise MetadataError(f"GET {url} answered HTTP {status}")
        try:
            events = json.loads(body).get("Events") or []
        except (ValueError, AttributeError) as err:
            raise MetadataError(
                f"GET {url} gave no scheduled events document: {body[:200]!r}"
            ) from err
        for event in events:
            if not isinstance(event, dict) or event.get("EventType") not in AZURE_NOTICE_TYPES:
                continue
            # Events go to every VM of an availability or scale set; Resources says whose it is.
            # If this VM's name cannot be read, take the event: a false alarm costs a restart,
            # a missed one costs the work since the last checkpoint.
            resources = event.get("Resources") or []
            name = self._own_name(timeout_s) if resources else None
            if resources and name is not None and name not in resources:
                continue
            action = str(event["EventType"]).lower()
            return Notice("azure", action, _parse_http_date(event.get("NotBefore")), event)
        return None

    def identify(self, timeout_s: float) -> bool:
        url = f"{self.base_url}/metadata/instance?api-version=2021-02-01"
        status, _, body = _request("GET", url, self.headers, timeout_s)
        if status != 200:
            return False
        try:
            compute = json.loads(body).get("compute")
        except (ValueError, AttributeError):
            return False
        return isinstance(compute, dict) and ("azEnvironment" in compute or "vmId" in compute)


_CLIENTS: dict[str, type[_Aws] | type[_Gcp] | type[_Azure]] = {
    "aws": _Aws,
    "gcp": _Gcp,
    "azure": _Azure,
}


def _check_provider(provider: str, allow_none: bool) -> None:
    allowed = (*PROVIDERS, "none") if allow_none else PROVIDERS
    if provider not in allowed:
        raise ValueError(
            f"preemption provider {provider!r} is unknown; use one of {', '.join(allowed)}"
            + (" ('none' disables the watcher)" if allow_none else "")
        )


def detect_provider(
    base_urls: Mapping[str, str] | Sequence[str] | None = None, timeout_s: float = 0.5
) -> str | None:
    """Which cloud's metadata service answers here: "aws", "gcp", "azure" or None.

    ``base_urls``: a mapping provider -> base URL (only those providers are probed), or a list
    of base URLs each probed for every provider (one configured metadata URL), or None for
    :data:`DEFAULT_BASE_URLS`. Tests must pass loopback URLs. Probes run in parallel with
    ``timeout_s`` per request, and the call returns within a few ``timeout_s`` even when name
    resolution hangs. If several providers answer, the order of :data:`PROVIDERS` decides.
    """
    if base_urls is None:
        targets = list(DEFAULT_BASE_URLS.items())
    elif isinstance(base_urls, Mapping):
        targets = list(base_urls.items())
    elif isinstance(base_urls, str):
        raise TypeError(
            f"base_urls={base_urls!r} is a single string; pass [url] to try every provider "
            f"there, or {{'aws': url}} for one provider"
        )
    else:
        targets = [(p, url) for url in base_urls for p in PROVIDERS]
    for provider, _ in targets:
        _check_provider(provider, allow_none=False)
    found: dict[str, bool] = {}

    def probe(provider: str, url: str) -> None:
        try:
            answered = _CLIENTS[provider](url).identify(timeout_s)
        except MetadataError:
            answered = False
        except Exception:
            log.exception("detecting provider %s at %s failed unexpectedly", provider, url)
            answered = False
        if answered:
            found[provider] = True

    # Daemon threads, not an executor: a DNS lookup that ignores the timeout must not block exit.
    threads = [
        threading.Thread(target=probe, args=t, daemon=True, name=f"m3run-detect-{t[0]}")
        for t in targets
    ]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 2 * timeout_s + 0.5  # AWS needs two requests
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    for provider in PROVIDERS:
        if found.get(provider):
            return provider
    return None


class PreemptionWatcher:
    """Polls one provider's metadata endpoint on a daemon thread; calls ``on_notice`` once.

    ``provider``: "aws", "gcp", "azure", or "none" (a watcher that never sends a request).
    ``base_url``: the metadata service; None takes :data:`DEFAULT_BASE_URLS`. After the first
    notice the thread stops polling; :attr:`notice` keeps it. Errors talking to the endpoint are
    logged at most once per :data:`ERROR_LOG_INTERVAL_S` and never raised.
    """

    def __init__(
        self,
        provider: str,
        base_url: str | None = None,
        poll_s: float = 5.0,
        on_notice: Callable[[Notice], None] | None = None,
        *,
        timeout_s: float = REQUEST_TIMEOUT_S,
    ) -> None:
        _check_provider(provider, allow_none=True)
        if not poll_s > 0:
            raise ValueError(f"poll_s={poll_s!r} must be a positive number of seconds, e.g. 5")
        if not timeout_s > 0:
            raise ValueError(f"timeout_s={timeout_s!r} must be a positive number of seconds")
        self.provider = provider
        self.poll_s = poll_s
        self.timeout_s = timeout_s
        self.on_notice = on_notice
        self.notice: Notice | None = None
        # Whether a save fits in this provider's notice (the supervisor asks, heartbeat by
        # heartbeat); the "none" watcher has no notice to fit in.
        self.save_budget = SaveBudget(provider, poll_s) if provider != "none" else None
        self.base_url: str | None = None
        self._client: _Aws | _Gcp | _Azure | None = None
        if provider != "none":
            self.base_url = (base_url or DEFAULT_BASE_URLS[provider]).rstrip("/")
            self._client = _CLIENTS[provider](self.base_url)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._fired = False
        self._lock = threading.Lock()
        self._last_error_log = float("-inf")
        self._suppressed = 0

    def check_once(self) -> Notice | None:
        """Poll once: the notice, or None (also on any error, which is logged rate-limited).

        Does not call ``on_notice``; the polling thread does that."""
        if self._client is None:
            return None
        try:
            notice = self._client.check(self.timeout_s)
        except MetadataError as err:
            self._log_error(str(err))
            return None
        except Exception as err:  # a bug here must not take the supervisor down
            self._log_error(f"unexpected {type(err).__name__}: {err}")
            return None
        if notice is not None and self.notice is None:
            self.notice = notice
        return notice

    def start(self) -> PreemptionWatcher:
        if self._client is None:
            log.info("preemption watcher disabled (provider 'none')")
            return self
        if self._thread is not None:
            return self
        self._stop.clear()
        self._thread = threading.Thread(
            target=self._run, daemon=True, name=f"m3run-preemption-{self.provider}"
        )
        self._thread.start()
        log.info(
            "watching for %s preemption notices at %s every %g s",
            self.provider,
            self.base_url,
            self.poll_s,
        )
        return self

    def stop(self, timeout_s: float = 2.0) -> None:
        """Stop polling; waits up to ``timeout_s`` for an in-flight request to finish."""
        self._stop.set()
        thread, self._thread = self._thread, None
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout_s)

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def __enter__(self) -> PreemptionWatcher:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _run(self) -> None:
        while not self._stop.is_set():
            notice = self.check_once()
            if notice is not None:
                self._fire(notice)
                return
            self._stop.wait(self.poll_s)

    def _fire(self, notice: Notice) -> None:
        with self._lock:
            if self._fired:
                return
            self._fired = True
        left = notice.seconds_left()
        log.warning(
            "%s preemption notice: action=%s, %s",
            notice.provider,
            notice.action,
            "deadline unknown" if left is None else f"{left:.0f} s left",
        )
        if self.on_notice is None:
            return
        try:
            self.on_notice(notice)
        except Exception:
            log.exception("the preemption on_notice callback raised; the notice stands")

    def _log_error(self, message: str) -> None:
        now = time.monotonic()
        if now - self._last_error_log < ERROR_LOG_INTERVAL_S:
            self._suppressed += 1
            return
        more = (
            f" ({self._suppressed} more in the last minute not logged)" if self._suppressed else ""
        )
        log.warning(
            "preemption watcher (%s): %s%s. Polling continues; if this machine is not on %s, "
            "set the preemption provider to 'none'.",
            self.provider,
            message,
            more,
            self.provider,
        )
        self._last_error_log = now
        self._suppressed = 0


def start_watcher(
    provider: str | None,
    base_url: str | None,
    poll_s: float,
    on_stop: Callable[[str], None],
    emit: Callable[..., None],
) -> PreemptionWatcher | None:
    """The supervisor's watcher: detect the provider when asked for "auto", start polling it,
    and call ``on_stop(detail)`` on a notice. ``emit(event, **fields)`` records what it does.
    None when watching is off or no metadata service answered."""
    if provider in (None, "none"):
        return None
    if provider == "auto":
        urls = {p: base_url for p in PROVIDERS} if base_url else None
        found = detect_provider(base_urls=urls, timeout_s=0.5)
        if found is None:
            emit(
                "preemption_watch",
                provider=None,
                reason="no cloud metadata service answered; preemption notices "
                "are not watched (set supervisor.preemption_provider to force one)",
            )
            return None
        provider = found

    def on_notice(notice: Notice) -> None:
        left = notice.seconds_left()
        when = "deadline unknown" if left is None else f"{left:.0f}s left"
        on_stop(f"{provider} preemption notice ({notice.action}, {when})")

    watcher = PreemptionWatcher(provider, base_url, poll_s, on_notice).start()
    emit(
        "preemption_watch",
        provider=provider,
        base_url=watcher.base_url,
        reason=f"polling {provider} every {poll_s:g}s",
    )
    return watcher
