"""Preemption notices: a cloud says it takes a host back at a deadline; vmmgr reclaims the host
against that deadline.

One watcher runs on each host (`vmmgr notice watch`, the vmmgr_worker role's vmmgr-notice unit) and
polls its source once a second:

- `gce`: the metadata server's `instance/preempted` turns TRUE about 30 s before the ACPI soft-off;
- `aws`: `spot/instance-action` (IMDSv2) names the action and its time, two minutes ahead;
- `file:PATH` and `http://...`: a JSON document `{"deadline_s": 30}` (seconds from when it was
  written) or `{"deadline_at": "<ISO 8601 or unix time>"}`, with an optional `"id"`; the lab, and
  any other scheduler that can write a file or serve a URL, use these.

Parsing is pure (tested on made-up documents); each notice is acted on once per host, whichever
watcher sees it, and recorded in the event log, the audit trail and the metrics.
"""

import hashlib
import json
import math
import os
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from datetime import datetime, timezone

from .errors import InvalidRequest

GCE_METADATA = "http://metadata.google.internal/computeMetadata/v1"
GCE_NOTICE_S = 30  # preempted → soft-off (Google's documented 30 s)
AWS_METADATA = "http://169.254.169.254"
HTTP_TIMEOUT = 2
SEEN_FOR = 86400  # s a notice's id is remembered


@dataclass(frozen=True)
class Notice:
    source: str  # gce, aws, file or http
    id: str
    deadline_at: float  # unix time
    detail: str


def parse_document(text: str, source: str, written_at: float) -> Notice | None:
    """`{"deadline_s": N}` (from `written_at`) or `{"deadline_at": ISO or unix}`, optional "id"."""
    if not text.strip():
        return None
    try:
        doc = json.loads(text)
    except ValueError:
        raise InvalidRequest(f"the {source} notice is not JSON") from None
    if not isinstance(doc, dict):
        raise InvalidRequest(f"the {source} notice must be a JSON object")
    seconds = doc.get("deadline_s")
    if "deadline_at" in doc:
        at = _instant(doc["deadline_at"])
    elif (isinstance(seconds, (int, float)) and not isinstance(seconds, bool)
          and math.isfinite(seconds)):
        at = written_at + float(seconds)
    else:
        raise InvalidRequest(f"the {source} notice needs deadline_s (a number) or deadline_at")
    ident = str(doc.get("id") or f"{at:.3f}")
    return Notice(source, ident[:80], at, str(doc.get("reason", ""))[:200])


def parse_gce(body: str, first_seen: float) -> Notice | None:
    """`instance/preempted`: TRUE once the VM is being preempted (soft-off in 30 s)."""
    if body.strip().upper() != "TRUE":
        return None
    return Notice("gce", f"preempted-{int(first_seen)}", first_seen + GCE_NOTICE_S,
                  "GCE preemption (instance/preempted = TRUE)")


def parse_aws(status: int, body: str) -> Notice | None:
    """`spot/instance-action`: 404 until AWS takes the instance back, then its action and time."""
    if status == 404 or not body.strip():
        return None
    try:
        doc = json.loads(body)
        when = doc["time"]
    except (ValueError, KeyError, TypeError):
        raise InvalidRequest("the AWS instance-action document has no time") from None
    at = _instant(when)
    return Notice("aws", f"{doc.get('action', 'terminate')}-{doc['time']}", at,
                  f"AWS spot interruption: {doc.get('action', 'terminate')} at {doc['time']}")


def _instant(value) -> float:
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        if not math.isfinite(value):
            raise InvalidRequest(f"{value!r} is not a time")
        return float(value)
    try:
        when = datetime.fromisoformat(str(value).replace("Z", "+00:00"))
    except ValueError:
        raise InvalidRequest(f"{str(value)[:40]!r} is not a time") from None
    return (when if when.tzinfo else when.replace(tzinfo=timezone.utc)).timestamp()


class FirstSeen:
    """When a notice that carries no time of its own (GCE's flag, a relative document) was
    first seen. In this process by default; `in_store` keeps it in the fleet's store, so a
    watcher restarted mid-notice keeps the deadline it had rather than granting itself more."""

    def __init__(self, r=None, host: str = ""):
        self.r, self.host, self.local = r, host, {}

    def first_seen(self, kind: str, what: str) -> float:
        digest = hashlib.sha256(what.encode()).hexdigest()[:16]
        now = time.time()
        if self.r is not None:
            key = f"vmmgr:notice-seen:{self.host}:{kind}"
            try:  # one value per kind: a different document replaces the one before
                self.r.set(key, f"{digest} {now}", nx=True, ex=SEEN_FOR)
                held, at = self.r.get(key).split()
                if held == digest:
                    self.r.expire(key, SEEN_FOR)  # kept while the notice is still there
                    return float(at)
                self.r.set(key, f"{digest} {now}", ex=SEEN_FOR)
                return now
            except Exception:  # noqa: BLE001 - the store is away: this process's memory
                pass
        held, at = self.local.get(kind, (None, now))
        if held != digest:
            self.local[kind] = (digest, now)
            return now
        return at

    def forget(self, kind: str) -> None:
        self.local.pop(kind, None)
        if self.r is not None:
            try:
                self.r.delete(f"vmmgr:notice-seen:{self.host}:{kind}")
            except Exception:  # noqa: BLE001 - forgotten when it expires
                pass


class Source:
    name = ""

    def __init__(self):
        self.memory = FirstSeen()  # the watcher hands it the fleet's store

    def poll(self) -> Notice | None:
        raise NotImplementedError


class FileSource(Source):
    name = "file"

    def __init__(self, path: str):
        super().__init__()
        self.path = path

    def poll(self) -> Notice | None:
        try:
            with open(self.path) as f:
                text, written = f.read(), os.fstat(f.fileno()).st_mtime
        except FileNotFoundError:
            return None
        return parse_document(text, "file", written)


class HttpSource(Source):
    name = "http"

    def __init__(self, url: str):
        super().__init__()
        self.url = url

    def poll(self) -> Notice | None:
        status, body = _get(self.url)
        if status == 404 or status == 200 and not body.strip():
            self.memory.forget("http")  # gone: the same document served later is a new notice
            return None
        if status != 200:
            return None  # the server does not answer: nothing known, nothing forgotten
        # the document's "deadline_s" counts from when a watcher of this host first saw it
        return parse_document(body, "http", self.memory.first_seen("http", body))


class GceSource(Source):
    name = "gce"

    def __init__(self, base: str = GCE_METADATA):
        super().__init__()
        self.base = base

    def poll(self) -> Notice | None:
        status, body = _get(f"{self.base}/instance/preempted",
                            {"Metadata-Flavor": "Google"})
        if status != 200:
            return None  # the metadata server does not answer: nothing known, nothing forgotten
        if body.strip().upper() != "TRUE":
            self.memory.forget("gce")  # not (or no longer) preempted: the next one is new
            return None
        return parse_gce(body, self.memory.first_seen("gce", "preempted"))


class AwsSource(Source):
    name = "aws"

    def __init__(self, base: str = AWS_METADATA):
        super().__init__()
        self.base = base

    def poll(self) -> Notice | None:
        _, token = _get(f"{self.base}/latest/api/token",
                        {"X-aws-ec2-metadata-token-ttl-seconds": "300"}, method="PUT")
        status, body = _get(f"{self.base}/latest/meta-data/spot/instance-action",
                            {"X-aws-ec2-metadata-token": token.strip()})
        return parse_aws(status, body) if status in (200, 404) else None


def source(spec: str) -> Source:
    """A source from its spec: gce, aws, file:PATH or an http(s) URL (gce=URL and aws=URL point
    those at another metadata server, as the tests do)."""
    if spec.startswith("file:"):
        return FileSource(spec[len("file:"):])
    if spec.startswith(("http://", "https://")):
        return HttpSource(spec)
    kind, _, base = spec.partition("=")
    if kind == "gce":
        return GceSource(base or GCE_METADATA)
    if kind == "aws":
        return AwsSource(base or AWS_METADATA)
    raise InvalidRequest(f"unknown notice source {spec!r} (gce, aws, file:PATH or a URL)")


def _get(url: str, headers: dict | None = None, method: str = "GET") -> tuple[int, str]:
    req = urllib.request.Request(url, headers=headers or {}, method=method)
    try:
        with urllib.request.urlopen(req, timeout=HTTP_TIMEOUT) as r:
            return r.status, r.read(65536).decode(errors="replace")
    except urllib.error.HTTPError as err:
        return err.code, ""
    except (OSError, ValueError):
        return 0, ""  # the metadata server does not answer: no notice, try again


STALE_AFTER_S = 60  # a notice whose deadline passed this long ago is history, not news


def is_stale(notice: Notice, now: float) -> bool:
    """A notice left behind (a file nobody removed, a document still served): its deadline is
    long past, so the host it named has been taken back or kept since. Acting on it would
    reclaim a host the operator has put back in service."""
    return notice.deadline_at < now - STALE_AFTER_S


def first_time(r, host: str, notice: Notice) -> bool:
    """True for the one watcher that acts on this notice (remembered for a day)."""
    return bool(r.set(f"vmmgr:notice:{host}:{notice.id}", str(notice.deadline_at), nx=True,
                      ex=SEEN_FOR))


def forget(r, host: str, notice: Notice) -> None:
    r.delete(f"vmmgr:notice:{host}:{notice.id}")
