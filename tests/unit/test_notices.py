"""Preemption notices: the documents each source serves, parsed; the GCE and AWS sources against
a local stand-in for their metadata servers (real HTTP, the clouds' paths and headers)."""

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from vmmgr import notices
from vmmgr.errors import InvalidRequest


def test_documents_give_a_deadline_from_when_written_or_an_instant():
    n = notices.parse_document('{"deadline_s": 30, "id": "n1"}', "file", written_at=1000)
    assert (n.deadline_at, n.id, n.source) == (1030, "n1", "file")
    n = notices.parse_document('{"deadline_at": "2026-12-03T12:00:30Z"}', "http", 0)
    assert n.deadline_at == notices._instant("2026-12-03T12:00:30+00:00")
    assert notices.parse_document("", "file", 0) is None  # an empty file: no notice yet
    for bad in ("[1]", "{}", '{"deadline_s": "soon"}', '{"deadline_s": true}', "{oops",
                '{"deadline_s": NaN}', '{"deadline_at": Infinity}', '{"deadline_at": "soon"}'):
        with pytest.raises(InvalidRequest):
            notices.parse_document(bad, "file", 0)


def test_gce_and_aws_documents():
    assert notices.parse_gce("FALSE", 1000) is None
    n = notices.parse_gce("TRUE", 1000)
    assert n.deadline_at == 1000 + 30 and n.source == "gce"
    assert notices.parse_aws(404, "") is None
    n = notices.parse_aws(200, '{"action": "terminate", "time": "2026-12-03T08:22:00Z"}')
    assert n.deadline_at == notices._instant("2026-12-03T08:22:00Z") and "terminate" in n.detail


class Metadata(BaseHTTPRequestHandler):
    """GCE's and AWS's metadata paths, answering as the clouds document (headers checked)."""
    preempted = "FALSE"
    action = None

    def do_GET(self):
        if self.path == "/computeMetadata/v1/instance/preempted":
            ok = self.headers.get("Metadata-Flavor") == "Google"
            return self._send(200 if ok else 403, self.preempted if ok else "")
        if self.path == "/latest/meta-data/spot/instance-action":
            if self.headers.get("X-aws-ec2-metadata-token") != "tok":
                return self._send(401, "")
            return self._send(200, json.dumps(self.action)) if self.action else self._send(404, "")
        self._send(404, "")

    def do_PUT(self):
        ok = self.path == "/latest/api/token" and self.headers.get(
            "X-aws-ec2-metadata-token-ttl-seconds")
        self._send(200 if ok else 400, "tok" if ok else "")

    def _send(self, status, body):
        data = body.encode()
        self.send_response(status)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):
        pass


@pytest.fixture
def metadata():
    server = ThreadingHTTPServer(("127.0.0.1", 0), Metadata)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    Metadata.preempted, Metadata.action = "FALSE", None


def test_the_gce_source_sees_preemption_with_thirty_seconds(metadata):
    src = notices.source(f"gce={metadata}/computeMetadata/v1")
    assert src.poll() is None
    Metadata.preempted = "TRUE"
    first = src.poll()
    assert first.source == "gce" and 29 < first.deadline_at - time.time() <= 30
    assert src.poll() == first  # the same notice on every poll: acted on once
    Metadata.preempted = "FALSE"  # the host came back; its next preemption is a new notice
    assert src.poll() is None
    Metadata.preempted = "TRUE"
    time.sleep(0.01)
    assert src.poll().deadline_at > first.deadline_at


def test_a_restarted_watcher_keeps_the_deadline_it_had(metadata, redis_url):
    """GCE's flag carries no time: the 30 s count from when a watcher of this host first saw
    it, kept in the store, so a watcher restarted mid-notice does not grant itself 30 s more."""
    import redis
    r = redis.Redis.from_url(redis_url, decode_responses=True)
    Metadata.preempted = "TRUE"
    before = notices.source(f"gce={metadata}/computeMetadata/v1")
    before.memory = notices.FirstSeen(r, "h1")
    first = before.poll()
    time.sleep(0.05)
    after = notices.source(f"gce={metadata}/computeMetadata/v1")
    after.memory = notices.FirstSeen(r, "h1")
    assert after.poll() == first
    other = notices.source(f"gce={metadata}/computeMetadata/v1")
    other.memory = notices.FirstSeen(r, "h2")  # another host's preemption is its own
    assert other.poll().deadline_at > first.deadline_at


def test_the_aws_source_asks_for_a_token_then_the_instance_action(metadata):
    src = notices.source(f"aws={metadata}")
    assert src.poll() is None
    Metadata.action = {"action": "stop", "time": "2026-12-03T08:22:00Z"}
    n = src.poll()
    assert n.source == "aws" and n.id == "stop-2026-12-03T08:22:00Z"


def test_the_file_source_and_refusals(tmp_path):
    src = notices.source(f"file:{tmp_path / 'notice.json'}")
    assert src.poll() is None
    (tmp_path / "notice.json").write_text('{"deadline_s": 20}')
    n = src.poll()
    assert n.deadline_at == pytest.approx((tmp_path / "notice.json").stat().st_mtime + 20)
    with pytest.raises(InvalidRequest, match="unknown notice source"):
        notices.source("azure")


def test_a_notice_is_acted_on_once_per_host(redis_url):
    import redis
    r = redis.Redis.from_url(redis_url, decode_responses=True)
    n = notices.Notice("file", "n1", 1000, "")
    assert notices.first_time(r, "h1", n) and not notices.first_time(r, "h1", n)
    assert notices.first_time(r, "h2", n)  # another host's notice is its own
    notices.forget(r, "h1", n)
    assert notices.first_time(r, "h1", n)


def test_a_notice_long_past_its_deadline_is_history_not_news():
    # a file left behind after the host was taken back and put in service again
    n = notices.Notice("file", "old", 1000, "")
    assert not notices.is_stale(n, now=1000 + 30)
    assert notices.is_stale(n, now=1000 + notices.STALE_AFTER_S + 1)


def test_a_malformed_aws_document_is_a_clear_refusal_not_a_crash():
    for body in ("<html>maintenance</html>", '{"action": "stop"}', "[1]"):
        with pytest.raises(InvalidRequest, match="no time"):
            notices.parse_aws(200, body)
