"""Preemption watchers against real HTTP metadata fakes on 127.0.0.1 (helpers/metadata_server.py).

No request in this file leaves the loopback interface: every watcher and every detection call
is given a 127.0.0.1 base URL (or the "none" provider, which sends nothing).
"""

from __future__ import annotations

import contextlib
import logging
import socket
import threading
import time
import urllib.error
import urllib.request

import pytest
from helpers.metadata_server import FakeMetadataServer

from m3run.runner.supervisor.preemption import (
    PROVIDERS,
    Notice,
    PreemptionWatcher,
    detect_provider,
)

POLL_S = 0.1


def closed_port_url() -> str:
    """A loopback URL where nothing listens (connection refused at once)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"http://127.0.0.1:{port}"


class Recorder:
    """An on_notice callback that keeps the notices; `probe`, if given, is read at the call."""

    def __init__(self, probe=None) -> None:
        self.notices: list[Notice] = []
        self.event = threading.Event()
        self.probe = probe
        self.probed: int | None = None

    def __call__(self, notice: Notice) -> None:
        self.notices.append(notice)
        if self.probe is not None:
            self.probed = self.probe()
        self.event.set()


def raw_get(url: str, headers: dict[str, str] | None = None, method: str = "GET") -> int:
    req = urllib.request.Request(url, headers=headers or {}, method=method)
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        with opener.open(req, timeout=2) as resp:
            return resp.status
    except urllib.error.HTTPError as err:
        return err.code


@pytest.mark.parametrize("provider", PROVIDERS)
def test_watcher_fires_once_within_two_polls_of_the_notice(provider: str) -> None:
    with FakeMetadataServer(provider) as srv:
        # Counted in metadata reads (GETs), not seconds: a loaded machine delays the polls.
        rec = Recorder(probe=lambda: srv.count("GET", "/"))
        watcher = PreemptionWatcher(provider, srv.base_url, poll_s=POLL_S, on_notice=rec)
        assert watcher.check_once() is None
        with watcher:
            time.sleep(3 * POLL_S)
            assert rec.notices == [], "no notice was announced yet"
            before = srv.count("GET", "/")
            srv.announce()
            assert rec.event.wait(30), f"{provider}: the notice was never seen"
            # A poll in flight at the announcement may miss it (one read); the next one must
            # not (one read, two on Azure, which reads its own name once it sees an event).
            most = 1 + (2 if provider == "azure" else 1)
            assert rec.probed is not None and rec.probed - before <= most, (before, rec.probed)
            time.sleep(3 * POLL_S)
        assert len(rec.notices) == 1, "on_notice must be called exactly once"
        notice = rec.notices[0]
        assert notice.provider == provider
        assert watcher.notice == notice
        assert notice.deadline is not None
        assert 0 < notice.seconds_left() <= 121
        assert not watcher.running


@pytest.mark.parametrize("action", ["terminate", "stop", "hibernate"])
def test_aws_instance_action_and_deadline(action: str) -> None:
    deadline = time.time() + 95
    with FakeMetadataServer("aws") as srv:
        watcher = PreemptionWatcher("aws", srv.base_url, poll_s=POLL_S)
        srv.announce(action=action, deadline=deadline)
        notice = watcher.check_once()
    assert notice is not None
    assert notice.action == action
    assert notice.raw["action"] == action
    assert notice.deadline == pytest.approx(int(deadline), abs=1)


def test_aws_uses_imdsv2_tokens_and_refreshes_an_expired_one() -> None:
    with FakeMetadataServer("aws") as srv:
        action_url = f"{srv.base_url}/latest/meta-data/spot/instance-action"
        srv.announce()
        assert raw_get(action_url) == 401, "the fake must refuse IMDSv1-style requests"
        assert raw_get(f"{srv.base_url}/latest/api/token", method="PUT") == 400

        watcher = PreemptionWatcher("aws", srv.base_url, poll_s=POLL_S)
        assert watcher.check_once() is not None
        assert srv.count("PUT", "/latest/api/token") == 2  # the raw one above, the watcher's
        gets = [r for r in srv.requests if r.method == "GET" and "instance-action" in r.path]
        assert gets[-1].headers.get("x-aws-ec2-metadata-token")

        assert watcher.check_once() is not None
        assert srv.count("PUT", "/latest/api/token") == 2, "a valid token is reused"

        srv.expire_tokens()
        assert watcher.check_once() is not None, "a 401 must fetch a fresh token and retry"
        assert srv.count("PUT", "/latest/api/token") == 3


def test_gcp_needs_the_flavor_header_and_preempted_true() -> None:
    with FakeMetadataServer("gcp") as srv:
        url = f"{srv.base_url}/computeMetadata/v1/instance/preempted"
        assert raw_get(url) == 403
        watcher = PreemptionWatcher("gcp", srv.base_url, poll_s=POLL_S)
        assert watcher.check_once() is None
        srv.announce()
        notice = watcher.check_once()
        assert notice is not None
        assert (notice.action, notice.raw) == ("preempt", "TRUE")
        assert 25 < notice.seconds_left() <= 30
        srv.clear()
        assert watcher.check_once() is None
        watcher_requests = srv.requests[1:]
        assert len(watcher_requests) == 3
        assert all(r.headers.get("metadata-flavor") == "Google" for r in watcher_requests)


def test_azure_needs_its_header_and_only_takes_preempt_events_for_this_vm() -> None:
    with FakeMetadataServer("azure", vm_name="trainer-7") as srv:
        events_url = f"{srv.base_url}/metadata/scheduledevents?api-version=2020-07-01"
        assert raw_get(events_url) == 400
        assert raw_get(f"{srv.base_url}/metadata/scheduledevents", {"Metadata": "true"}) == 400

        watcher = PreemptionWatcher("azure", srv.base_url, poll_s=POLL_S)
        assert watcher.check_once() is None
        srv.announce("Freeze")
        assert watcher.check_once() is None, "a Freeze is not a preemption"
        srv.announce("Preempt", resources=["trainer-8"])
        assert watcher.check_once() is None, "an eviction of another VM in the set"

        deadline = time.time() + 40
        srv.announce("Preempt", deadline=deadline)
        notice = watcher.check_once()
        assert notice is not None
        assert notice.action == "preempt"
        assert notice.raw["Resources"] == ["trainer-7"]
        assert notice.deadline == pytest.approx(int(deadline), abs=1)

        srv.announce("Terminate")
        terminate = watcher.check_once()
        assert terminate is not None and terminate.action == "terminate"


@pytest.mark.parametrize("provider", PROVIDERS)
def test_detect_provider_picks_the_one_that_answers(provider: str) -> None:
    with FakeMetadataServer(provider) as srv:
        # As with the real defaults, where AWS and Azure share one address, every provider's
        # probe goes to the same server; only the right protocol may claim it.
        urls = dict.fromkeys(PROVIDERS, srv.base_url)
        assert detect_provider(urls, timeout_s=0.5) == provider
        assert detect_provider([srv.base_url], timeout_s=0.5) == provider


def test_detect_provider_with_all_three_fakes_and_with_nothing_listening() -> None:
    with (
        FakeMetadataServer("aws") as aws,
        FakeMetadataServer("gcp") as gcp,
        FakeMetadataServer("azure") as azure,
    ):
        urls = {"azure": azure.base_url, "gcp": gcp.base_url}
        assert detect_provider(urls) == "gcp", "the PROVIDERS order breaks ties"
        assert detect_provider({"azure": azure.base_url}) == "azure"
        assert detect_provider({"gcp": aws.base_url, "azure": aws.base_url}) is None

    dead = closed_port_url()
    start = time.monotonic()
    assert detect_provider(dict.fromkeys(PROVIDERS, dead), timeout_s=0.3) is None
    assert time.monotonic() - start < 2.0


def test_detect_provider_rejects_unknown_providers_and_bare_strings() -> None:
    with pytest.raises(ValueError, match=r"'oracle' is unknown; use one of aws, gcp, azure"):
        detect_provider({"oracle": "http://127.0.0.1:9"})
    with pytest.raises(TypeError, match="pass \\[url\\]"):
        detect_provider("http://127.0.0.1:9")  # type: ignore[arg-type]


def test_unreachable_endpoint_never_raises_and_logs_once(caplog: pytest.LogCaptureFixture) -> None:
    rec = Recorder()
    caplog.set_level(logging.WARNING, logger="m3run.runner.supervisor.preemption")
    watcher = PreemptionWatcher("aws", closed_port_url(), poll_s=0.02, on_notice=rec)
    with watcher:
        time.sleep(0.4)
        assert watcher.running, "errors must not stop the polling thread"
    assert rec.notices == []
    assert watcher.notice is None
    errors = [r for r in caplog.records if "preemption watcher (aws)" in r.getMessage()]
    assert len(errors) == 1, [r.getMessage() for r in errors]
    assert "hop limit" in errors[0].getMessage()
    assert "set the preemption provider to 'none'" in errors[0].getMessage()


def test_a_failing_endpoint_recovers_and_the_notice_still_arrives(
    caplog: pytest.LogCaptureFixture,
) -> None:
    rec = Recorder()
    caplog.set_level(logging.WARNING, logger="m3run.runner.supervisor.preemption")
    with FakeMetadataServer("gcp") as srv:
        srv.fail(503)
        with PreemptionWatcher("gcp", srv.base_url, poll_s=0.02, on_notice=rec):
            time.sleep(0.2)
            assert rec.notices == []
            srv.recover()
            srv.announce()
            assert rec.event.wait(5)
    errors = [r.getMessage() for r in caplog.records if "HTTP 503" in r.getMessage()]
    assert len(errors) == 1


def test_a_raising_callback_does_not_kill_the_watcher(caplog: pytest.LogCaptureFixture) -> None:
    calls = []

    def boom(notice: Notice) -> None:
        calls.append(notice)
        raise RuntimeError("supervisor bug")

    with FakeMetadataServer("aws") as srv:
        srv.announce()
        watcher = PreemptionWatcher("aws", srv.base_url, poll_s=POLL_S, on_notice=boom)
        with watcher:
            deadline = time.monotonic() + 5
            while not calls and time.monotonic() < deadline:
                time.sleep(0.01)
    assert len(calls) == 1
    assert watcher.notice is not None
    assert any("on_notice callback raised" in r.getMessage() for r in caplog.records)


def test_stop_is_prompt_even_with_a_long_poll_interval() -> None:
    with FakeMetadataServer("gcp") as srv:
        watcher = PreemptionWatcher("gcp", srv.base_url, poll_s=60).start()
        time.sleep(0.1)
        start = time.monotonic()
        watcher.stop()
        assert time.monotonic() - start < 1.0
        assert not watcher.running


def test_provider_none_sends_nothing_and_bad_settings_are_named() -> None:
    watcher = PreemptionWatcher("none", None, on_notice=Recorder())
    assert watcher.base_url is None
    assert watcher.check_once() is None
    watcher.start()
    assert not watcher.running
    watcher.stop()

    with pytest.raises(ValueError, match=r"provider 'ibm' is unknown; use one of .*'none'"):
        PreemptionWatcher("ibm", None)
    with pytest.raises(ValueError, match=r"poll_s=0 must be a positive number"):
        PreemptionWatcher("aws", "http://127.0.0.1:9", poll_s=0)


def test_the_save_budget_against_each_providers_notice() -> None:
    from m3run.runner.supervisor.save_budget import NOTICE_S, SAVE_BUDGET_SHARE, save_budget_warning

    assert save_budget_warning("gcp", 5.0, 0.4, 2.0, None) is None  # no checkpoint yet
    assert save_budget_warning("gcp", 5.0, 0.4, 2.0, 12.0) is None  # 19.4 s of 30: fits
    tight = save_budget_warning("gcp", 5.0, 0.4, 2.0, 16.0)  # 23.4 s: most of the notice
    assert tight is not None and "most of the 30 s" in tight
    assert save_budget_warning("aws", 5.0, 0.4, 2.0, 40.0) is None  # AWS gives two minutes
    late = save_budget_warning("azure", 5.0, 0.4, 2.0, 40.0)
    assert late is not None and "more than the 30 s an azure notice" in late
    for provider, notice in NOTICE_S.items():  # the share is the line, for every provider
        edge = SAVE_BUDGET_SHARE * notice - 5.0
        assert save_budget_warning(provider, 5.0, 0.0, 0.0, edge) is None
        assert save_budget_warning(provider, 5.0, 0.0, 0.0, edge + 0.5) is not None


def test_a_poll_against_an_endpoint_that_trickles_its_body_returns_within_the_bound() -> None:
    """Each byte comes well within the per-recv timeout, so only a bound on the whole request
    ends the poll: the GCP answer, TRUE, would otherwise take a minute to arrive."""
    stop = threading.Event()

    def serve(conn: socket.socket) -> None:
        with conn:
            conn.recv(4096)
            conn.sendall(
                b"HTTP/1.1 200 OK\r\nMetadata-Flavor: Google\r\nContent-Type: text/plain\r\n"
                b"Content-Length: 60\r\n\r\n"
            )
            for _ in range(60):
                if stop.wait(0.5):
                    return
                with contextlib.suppress(OSError):
                    conn.sendall(b" ")

    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        port = listener.getsockname()[1]
        accept = threading.Thread(
            target=lambda: serve(listener.accept()[0]), daemon=True, name="trickle"
        )
        accept.start()
        watcher = PreemptionWatcher(
            "gcp", f"http://127.0.0.1:{port}", poll_s=60, on_notice=Recorder(), timeout_s=1.0
        )
        started = time.monotonic()
        try:
            assert watcher.check_once() is None
            assert time.monotonic() - started < 2.0
        finally:
            stop.set()
            accept.join(5)
