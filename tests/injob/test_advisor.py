"""``recommended_checkpoint_interval``: the service's interval, polled over HTTP in the background, read
without waiting (torch-free). A stdlib HTTP server on 127.0.0.1 stands in for the API and answers what
``GET /v1/runs/{job}/health`` answers (the ``checkpoint`` object built by the service's own code); a
handler held on an event the test controls is a slow API."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import orjson
import pytest

from fleethealth.errors import ConfigError
from fleethealth.injob import advisor as advisor_mod
from fleethealth.injob.advisor import IntervalAdvisor, recommended_checkpoint_interval
from fleethealth.policy.interval import IntervalEstimator, JobSpan


class _Api:
    def __init__(self) -> None:
        self.body = b"{}"
        self.status = 200
        self.release = threading.Event()
        self.release.set()
        self.paths: list[str] = []
        self.auth: list[str | None] = []


@pytest.fixture
def api() -> Iterator[tuple[_Api, str]]:
    state = _Api()

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802
            state.paths.append(self.path)
            state.auth.append(self.headers.get("Authorization"))
            state.release.wait(30)
            self.send_response(state.status)
            self.send_header("Content-Type", "application/json")
            self.end_headers()
            self.wfile.write(state.body)

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield state, f"http://127.0.0.1:{server.server_address[1]}"
    state.release.set()
    server.shutdown()
    server.server_close()


def _health(interval_job_nodes: int = 4) -> bytes:
    advice = IntervalEstimator().estimate("llm/7b run", at=3600.0, spans=[JobSpan("llm/7b run", interval_job_nodes,
                                                                                   0.0, 3600.0)], interruptions=[])
    return orjson.dumps({"job": "llm/7b run", "checkpoint": advice.to_obj()})


def test_poll_reads_the_interval_and_keeps_the_last_one_when_the_api_fails(api):
    state, url = api
    adv = IntervalAdvisor("llm/7b run", url=url + "/", token="read-tok", timeout_s=5.0)
    assert adv.value is None
    state.body = _health()
    expected = orjson.loads(state.body)["checkpoint"]["interval_s_recommended"]
    assert adv.poll_once() == pytest.approx(expected) and adv.updated.is_set()
    assert state.paths == ["/v1/runs/llm%2F7b%20run/health"] and state.auth == ["Bearer read-tok"]
    assert adv.answer["basis"]["c"]["source"] == "default"
    for body, status in ((b"not json", 200), (b'{"checkpoint": {"interval_s_recommended": -1}}', 200),
                         (b'{"detail": "unknown job"}', 404)):
        state.body, state.status = body, status
        assert adv.poll_once() == pytest.approx(expected)            # the last value stays
    assert adv.errors_total == 3
    state.body, state.status = b'{"checkpoint": null}', 200
    assert adv.poll_once() == pytest.approx(expected) and adv.errors_total == 3   # no advice yet: no error


def test_get_never_waits_for_a_slow_api(api):
    state, url = api
    state.body = _health()
    state.release.clear()                                    # the API does not answer until the test says
    adv = IntervalAdvisor("llm/7b run", url=url, poll_s=3600.0, timeout_s=30.0)
    assert adv.get() is None                                 # returned while the request is held
    assert not adv.updated.is_set()
    state.release.set()
    assert adv.updated.wait(30)
    assert adv.get() == pytest.approx(orjson.loads(state.body)["checkpoint"]["interval_s_recommended"])
    adv.close()


def test_no_api_configured_means_none_and_no_thread(monkeypatch):
    monkeypatch.delenv("FLEETHEALTH_API", raising=False)
    monkeypatch.setenv("FLEETHEALTH_JOB", "llm")
    monkeypatch.setattr(advisor_mod, "_default", None)
    assert recommended_checkpoint_interval() is None
    assert advisor_mod._default is not None and advisor_mod._default._thread is None
    with pytest.raises(ConfigError, match="poll_s"):
        IntervalAdvisor("llm", url="http://x", poll_s=0)


def test_the_module_call_follows_the_environment(api, monkeypatch):
    state, url = api
    state.body = _health(8)
    monkeypatch.setenv("FLEETHEALTH_API", url)
    monkeypatch.setattr(advisor_mod, "_default", None)
    first = recommended_checkpoint_interval("llm/7b run")
    adv = advisor_mod._default
    assert first is None or first > 0
    assert adv.updated.wait(30)
    assert recommended_checkpoint_interval("llm/7b run") == adv.value > 0
    adv.close()
