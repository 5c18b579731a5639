"""Fleet state in Redis: what the task API, the CLI and the web console read without asking every
host, and what only the control plane knows.

libvirt stays the ground truth for where a VM runs; the records here mirror it (reconcile repairs
any drift and says so in the event log) and add what libvirt cannot tell: the operation in flight
on each VM, every migration attempt, the tasks submitted, and the event log. Locks live here too:
one operation per VM (and per host) at a time, with an expiry so a dead worker never holds one
for ever.
"""

import json
import os
import time
from functools import cached_property

import orjson
import redis

from . import audit, metrics
from .errors import Conflict

P = "vmmgr:"
EVENTS_KEPT = 10_000
TASKS_KEPT = 500
UNLISTED_TASK_TTL = 86400  # s: the record of a task `add_task` never listed (the beat's)
MIGRATIONS_KEPT = 100  # attempts per VM
USAGE = P + "usage"  # every VM state change, for usage metering (vmmgr.usage)
USAGE_KEPT = 1_000_000  # entries (~100 bytes each)
# Once a day, every VM's state with the usage stream's position: a report replays the stream from
# the newest baseline before its window, not from the stream's start.
USAGE_BASELINES = P + "usage:baselines"  # sorted set "<stream id> <time>" by time
USAGE_BASELINE_EVERY = 86400
USAGE_BASELINE_DAYS = int(os.environ.get("VMMGR_USAGE_BASELINE_DAYS", "62"))
CLOCK_SLACK = 300  # s: entries carry their writer's clock, the stream's ids the store's
CAPACITY = P + "capacity"  # the fleet's memory over time, for the console's chart
CAPACITY_KEPT = 7 * 24 * 60

# Compare-and-act on a lock's owner in one step, so a late or duplicate worker never extends or
# frees a lock that has since passed to someone else.
# A lock's value is "<owner> <what>".
_OWNED = "local v = redis.call('get', KEYS[1]) " \
         "if v and string.sub(v, 1, #ARGV[1] + 1) == ARGV[1] .. ' ' then "
_REFRESH = _OWNED + "return redis.call('expire', KEYS[1], ARGV[2]) else return 0 end"
_RELEASE = _OWNED + "return redis.call('del', KEYS[1]) else return 0 end"

# The fleet view's rows: KEYS view, stamps, sequence. An operation's row is stamped with the
# sequence's next value (a drop too: its stamp outlives the row).
_SET_VIEW = """
local seq = redis.call('incr', KEYS[3])
if ARGV[2] == '' then redis.call('hdel', KEYS[1], ARGV[1])
else redis.call('hset', KEYS[1], ARGV[1], ARGV[2]) end
redis.call('hset', KEYS[2], ARGV[1], seq)
"""
# An observer's rows (ARGV: since, lock prefix, whole, then name/row pairs, '' for gone) land
# where no operation holds the VM and none wrote its row after `since`; a whole look also drops
# the rows of VMs it did not see and the stamps it supersedes, and says so (KEYS[4]): a look
# begun before that one began is older than it everywhere, and lands nowhere (the stamps that
# would have told it so are gone). Returns the names left alone.
_OBSERVE_VIEW = """
local since, lock, whole = tonumber(ARGV[1]), ARGV[2], ARGV[3] == '1'
if tonumber(redis.call('get', KEYS[4]) or '0') > since then
  local all = {}
  for i = 4, #ARGV, 2 do table.insert(all, ARGV[i]) end
  return all
end
local seen = {}
for i = 4, #ARGV, 2 do seen[ARGV[i]] = ARGV[i + 1] end
if whole then
  for _, name in ipairs(redis.call('hkeys', KEYS[1])) do
    if seen[name] == nil then seen[name] = '' end
  end
end
local left = {}
for name, row in pairs(seen) do
  if redis.call('exists', lock .. name) == 1
      or tonumber(redis.call('hget', KEYS[2], name) or '0') > since then
    table.insert(left, name)
  elseif row == '' then redis.call('hdel', KEYS[1], name)
  else redis.call('hset', KEYS[1], name, row) end
end
if whole then
  local stamps = redis.call('hgetall', KEYS[2])
  for i = 1, #stamps, 2 do
    if tonumber(stamps[i + 1]) <= since then redis.call('hdel', KEYS[2], stamps[i]) end
  end
  redis.call('set', KEYS[4], since)
end
return left
"""


_VIEW_KEYS = (P + "view:vms", P + "view:stamps", P + "view:seq")

SAVED = ("suspended", "resuming")  # states of a VM whose image is on storage


def usage_state(state: str, saved_as: str | None) -> str:
    """A state as usage counts it: a saved VM as its suspend said it was saved (suspended,
    parked or hibernated), whoever records it."""
    return (saved_as or "suspended") if state in SAVED else state


def _baseline_key(member: str) -> str:
    return f"{USAGE_BASELINES}:{member.split(' ')[1]}"


STORE_WAIT = 300  # s an outcome that has happened waits for the store to come back


def stored(write, wait: float = STORE_WAIT):
    """`write()`, retried while the store is out of reach: for what records an outcome that has
    already happened (a VM moved), which an outage must delay, not lose. Past `wait` the error
    is raised; the reconcile repairs the record from libvirt then."""
    deadline, delay = time.monotonic() + wait, 0.5
    while True:
        try:
            return write()
        except redis.RedisError:
            if time.monotonic() + delay > deadline:
                raise
            time.sleep(delay)
            delay = min(delay * 2, 10)


class FleetState:
    def __init__(self, url: str):
        self.url = url

    @cached_property
    def r(self) -> redis.Redis:
        return redis.Redis.from_url(self.url, decode_responses=True, socket_timeout=10)

    @cached_property
    def raw(self) -> redis.Redis:
        """Replies as bytes: for what goes straight to a JSON parser."""
        return redis.Redis.from_url(self.url, socket_timeout=10)

    # ---- event log ----------------------------------------------------------------------

    def event(self, message: str, *, kind: str = "info", vm: str = "", host: str = "",
              task: str = "") -> None:
        self.r.xadd(P + "events", {"time": f"{time.time():.3f}", "kind": kind, "vm": vm,
                                   "host": host, "task": task, "message": message},
                    maxlen=EVENTS_KEPT, approximate=True)

    def events(self, count: int = 50, after: str = "-", vm: str | None = None) -> list[dict]:
        """Oldest first. `after` is an event id (exclusive) to read only what is new."""
        if after == "-":  # the newest `count`, put back in order
            entries = list(reversed(self.r.xrevrange(P + "events", count=count)))
        else:
            entries = self.r.xrange(P + "events", min=f"({after}", count=count)
        out = [{"id": eid, **fields} for eid, fields in entries]
        return [e for e in out if vm is None or e.get("vm") == vm]

    # ---- VMs ----------------------------------------------------------------------------

    def set_vm(self, name: str, **fields) -> None:
        """Change the VM's record; a change of state is also appended to the usage stream (a
        saved VM as its suspend said it was saved: suspended, parked or hibernated)."""
        now = time.time()
        fields["updated"] = f"{now:.3f}"
        usage = None
        if fields.get("state") in SAVED:
            usage = usage_state(fields["state"], fields.get("saved_as")
                                or self.r.hget(P + f"vm:{name}", "saved_as"))
        pipe = self.r.pipeline()  # MULTI: the record and its usage entry land together
        pipe.hset(P + f"vm:{name}", mapping={k: _str(v) for k, v in fields.items()})
        pipe.sadd(P + "vms", name)
        if "state" in fields:
            pipe.xadd(USAGE, {"time": f"{now:.3f}", "vm": name,
                              "state": usage or fields["state"]},
                      maxlen=USAGE_KEPT, approximate=True)
        pipe.execute()

    def usage_entries(self, since: float = 0, until: float | None = None) -> list[dict]:
        """What `usage.account` needs for [since, until): the newest baseline at or before
        `since` as one entry per VM, then the stream's changes after it (or the whole stream
        when no baseline is that old)."""
        upto = "+" if until is None else int((until + CLOCK_SLACK) * 1000)
        found = self.r.zrevrangebyscore(USAGE_BASELINES, since, "-inf", start=0, num=1)
        states = self.r.hgetall(_baseline_key(found[0])) if found else {}
        if not states:
            return [fields for _, fields in self.r.xrange(USAGE, max=upto)]
        last_id, at = found[0].split(" ")
        entries = [{"time": at, "vm": vm, "state": state} for vm, state in states.items()
                   if not vm.startswith("@")]
        for _, fields in self.r.xrange(USAGE, min=f"({last_id}", max=upto):
            # after the baseline in the store's order, whatever the writer's clock said
            entries.append(fields | {"time": str(max(float(fields["time"]), float(at)))})
        return entries

    def write_usage_baseline(self, every: float = USAGE_BASELINE_EVERY) -> bool:
        """Every VM's state and the usage stream's end, read at one instant (MULTI), at most
        once per `every` seconds (the reconcile offers it each pass). Also what makes a VM
        whose state predates the stream (an upgrade) known from then on."""
        if not self.r.set(USAGE + ":baseline-gate", "1", nx=True, ex=int(every)):
            return False
        for _ in range(5):
            names = sorted(self.r.smembers(P + "vms"))
            pipe = self.r.pipeline()  # MULTI: reads too run at one instant
            pipe.smembers(P + "vms")
            for name in names:
                pipe.hmget(P + f"vm:{name}", "state", "saved_as")
            pipe.xrevrange(USAGE, count=1)
            out = pipe.execute()
            if sorted(out[0]) == names:  # no VM came or went between the two reads
                break
        else:
            self.r.delete(USAGE + ":baseline-gate")
            return False
        now = time.time()
        member = f"{out[-1][0][0] if out[-1] else '0-0'} {now:.3f}"
        states = {name: usage_state(state, saved_as)
                  for name, (state, saved_as) in zip(names, out[1:-1]) if state}
        kept = USAGE_BASELINE_DAYS * 86400
        pipe = self.r.pipeline()
        pipe.hset(_baseline_key(member), mapping=states or {"@empty": "1"})
        pipe.expire(_baseline_key(member), kept)
        pipe.zadd(USAGE_BASELINES, {member: now})
        pipe.zremrangebyscore(USAGE_BASELINES, "-inf", now - kept)
        pipe.execute()
        return True

    def vm(self, name: str) -> dict:
        return self.r.hgetall(P + f"vm:{name}")

    def vms(self) -> dict[str, dict]:
        names = sorted(self.r.smembers(P + "vms"))
        pipe = self.r.pipeline(transaction=False)  # one round trip, not one per VM
        for name in names:
            pipe.hgetall(P + f"vm:{name}")
        return dict(zip(names, pipe.execute()))

    def forget_vm(self, name: str) -> None:
        pipe = self.r.pipeline()
        pipe.delete(P + f"vm:{name}")
        pipe.srem(P + "vms", name)
        pipe.xadd(USAGE, {"time": f"{time.time():.3f}", "vm": name, "state": "gone"},
                  maxlen=USAGE_KEPT, approximate=True)
        pipe.execute()

    def record(self, kind: str, vm: str, details: dict) -> None:
        """Apply one step's outcome, as `reclaim` and the tasks report it, to the VM's records."""
        if kind == "migrating":
            self.set_vm(vm, state="migrating", target=details["target"])
        elif kind in ("migrated", "migration_failed"):
            status = "completed" if kind == "migrated" else "failed"
            self.add_migration(vm, {"status": status, **details})
            pipe = self.r.pipeline(transaction=False)
            metrics.migration(pipe, status, details)
            if kind == "migrated" and details.get("downtime_ms") is not None:
                pipe.xadd(USAGE, {"time": f"{time.time():.3f}", "vm": vm,
                                  "blackout_ms": details["downtime_ms"]},
                          maxlen=USAGE_KEPT, approximate=True)
            pipe.execute()
            if kind == "migrated":
                self.set_vm(vm, state="running", host=details["target"], target="", source="",
                            policy="", bandwidth="")
            else:  # a failed migration leaves the VM on its source
                self.set_vm(vm, state="running", host=details["source"], target="")
        elif kind == "postcopy_paused":  # paused on both hosts until the migration resumes
            self.add_migration(vm, {"status": "postcopy-paused", **details})
            self.set_vm(vm, state="postcopy-paused", host=details["target"],
                        source=details["source"], target=details["target"],
                        policy=details["policy"], bandwidth=details.get("bandwidth", 0),
                        recovery_tries=0, recovery_at=0)
        elif kind == "suspending":
            self.set_vm(vm, state="suspending")
        elif kind == "suspended":
            how = ("hibernated" if details.get("mode") == "guest" else
                   "stopped" if details.get("mode") == "stopped" else
                   "parked" if details.get("parked") else "suspended")
            self.set_vm(vm, state="suspended", host="", target="", saved_as=how)
        elif kind == "resuming":
            self.set_vm(vm, state="resuming", target=details["target"])
        elif kind == "resumed":
            self.set_vm(vm, state=details.get("state", "running"), host=details["host"],
                        target="", saved_as="")
        elif kind == "resume_failed":
            self.set_vm(vm, state="suspended", target="")
        else:
            raise ValueError(f"unknown record kind {kind!r}")

    # ---- the fleet view: one row per VM, what listings and pages read ----------------------
    # One hash, so a listing of 20,000 VMs is one round trip. Two kinds of writer: the
    # operation that changed a VM writes its row holding the VM's lock (`set_vm_view`), and is
    # right by construction; an observer (a lifecycle event, the reconcile) holds no lock and
    # read libvirt a moment ago, so its rows land only where no operation holds the VM now or
    # wrote its row since the observer began to look (`observe_vm_views`). Else a suspend's
    # own event, read as the image was being written, could drop the suspended VM's row after
    # the suspend wrote it.

    def set_vm_view(self, name: str, row: dict | None) -> None:
        """The row of an operation holding the VM's lock (None: the VM is gone)."""
        self.r.eval(_SET_VIEW, 3, *_VIEW_KEYS, name, json.dumps(row) if row else "")

    def view_mark(self) -> int:
        """Where the view's writes stand: an observer's `since`, taken before it looks."""
        return int(self.r.get(P + "view:seq") or 0)

    def observe_vm_views(self, rows: dict[str, dict | None], since: int,
                         whole: bool = False) -> list[str]:
        """An observer's rows by name (None: not found), as seen since `since`; `whole`: every
        VM, the rows of any other dropped. Returns the VMs left to the operation on them."""
        args = [a for name, row in rows.items() for a in (name, json.dumps(row) if row else "")]
        return self.r.eval(_OBSERVE_VIEW, 4, *_VIEW_KEYS, P + "view:pruned", since,
                           P + "lock:vm:", "1" if whole else "0", *args)

    def replace_vm_views(self, rows: list[dict]) -> None:
        """The whole view, unconditionally (a seeded store: tests and benchmarks)."""
        pipe = self.r.pipeline()  # MULTI: readers see the old view or the new one
        pipe.delete(P + "view:vms")
        if rows:
            pipe.hset(P + "view:vms", mapping={r["name"]: json.dumps(r) for r in rows})
        pipe.execute()

    def vm_views(self) -> list[dict]:
        # One parse of all the rows (orjson, from the bytes as they came), not one per row.
        return orjson.loads(b"[" + b",".join(self.raw.hvals(P + "view:vms")) + b"]")

    def vm_views_json(self) -> str:
        """The rows as one JSON array, by name, one a line: a listing that needs no parsing."""
        rows = self.r.hgetall(P + "view:vms")
        return "[" + ",\n".join(rows[name] for name in sorted(rows)) + "]"

    def vm_view(self, name: str) -> dict | None:
        row = self.r.hget(P + "view:vms", name)
        return json.loads(row) if row else None

    # ---- links: the rate the last move over each (source to target) measured ---------------

    def link_mibps(self, source: str, target: str) -> float | None:
        value = self.r.hget(P + "links", f"{source}>{target}")
        return float(value) if value else None

    def set_link_mibps(self, source: str, target: str, mibps: float) -> None:
        self.r.hset(P + "links", f"{source}>{target}", f"{mibps:.1f}")

    def link_overhead_s(self, source: str, target: str) -> float | None:
        """A move's wall time outside QEMU's copy over this link (None: none measured): a
        move between sites pays its round trips there (QEMU's start on the target, TLS,
        libvirt's steps, the switch-over), which the fleet's average of mostly near moves
        would hide."""
        value = self.r.hget(P + "links:overhead", f"{source}>{target}")
        return float(value) if value and float(value) > 0 else None  # 0: as `measured_rates`

    def learn_link_overhead(self, source: str, target: str, overhead_s: float) -> None:
        """Each link's running average, the newest move weighing a quarter (as `learn_move`)."""
        key = f"{source}>{target}"
        old = self.r.hget(P + "links:overhead", key)
        new = overhead_s if not old else 0.75 * float(old) + 0.25 * overhead_s
        self.r.hset(P + "links:overhead", key, f"{new:.2f}")

    # ---- a cancel asked of a move before its libvirt job (a base image being sent) ----------

    def ask_cancel(self, vm: str, owner: str, ttl: int = 60) -> None:
        """Ask the move that `owner` (its lock's holder) runs to end."""
        self.r.set(P + f"cancel:{vm}", owner, ex=ttl)

    def cancel_asked(self, vm: str, owner: str) -> bool:
        """Whether a cancel was asked of this owner's move; taken (deleted) if so."""
        return bool(self.r.eval(
            "if redis.call('get', KEYS[1]) == ARGV[1] then return redis.call('del', KEYS[1]) "
            "end return 0", 1, P + f"cancel:{vm}", owner))

    def cancel_pending(self, vm: str) -> bool:
        return bool(self.r.exists(P + f"cancel:{vm}"))

    def drop_cancel(self, vm: str) -> None:
        self.r.delete(P + f"cancel:{vm}")

    # ---- console segments (`site_consoles`): numbered here, as sites keep their files apart --

    def next_console_number(self, vm: str) -> int:
        """A number for a new segment of the VM's console. The count is never reset (a destroy
        forgets the segments, not it): a file left on a site that did not answer is never taken
        up by a new segment of the same name (QEMU appends)."""
        return int(self.r.hincrby(P + "console:" + vm, "next", 1))

    def add_console_segment(self, vm: str, seq: int, host: str) -> None:
        """Segment `seq` of the VM's console is `host`'s: readers see it from now on."""
        self.r.hset(P + "console:" + vm, str(seq), host)

    def console_segments(self, vm: str) -> list[tuple[int, str]]:
        """(number, host) of each of the VM's segments, in order."""
        return sorted((int(k), h) for k, h in self.r.hgetall(P + "console:" + vm).items()
                      if k.isdigit())

    def forget_console_segments(self, vm: str, seqs: list[int]) -> None:
        if seqs:
            self.r.hdel(P + "console:" + vm, *map(str, seqs))

    def console_drop_pending(self, vm: str, seq: int) -> None:
        """Segment `seq` of a failed move is to be given back once its site answers."""
        self.r.sadd(P + "console-drops", json.dumps([vm, seq]))

    def console_drop_done(self, vm: str, seq: int) -> None:
        self.r.srem(P + "console-drops", json.dumps([vm, seq]))

    def console_drops(self) -> list[tuple[str, int]]:
        return sorted(tuple(json.loads(m)) for m in self.r.smembers(P + "console-drops"))

    # ---- saves (`suspend`): what each VM's save folder holds, for readers that cannot see it --
    # The folder on storage decides (a resume claims it by a rename); this is its copy, written
    # under the VM's lock after each step and by the reconcile's pass over the folders, so a
    # listing, the web console or a reclaim on a node without that storage knows the saves.

    def put_save(self, vm: str, save: dict) -> None:
        """{"state": "saving" | "saved" | "claimed", "intent", "record", "address", "disk"}:
        see `suspend.folder_save`."""
        self.r.hset(P + "saves", vm, json.dumps(save))

    def forget_save(self, vm: str) -> None:
        self.r.hdel(P + "saves", vm)

    def save_of(self, vm: str) -> dict | None:
        raw = self.r.hget(P + "saves", vm)
        return json.loads(raw) if raw else None

    def saves(self) -> dict[str, dict]:
        return {vm: json.loads(raw) for vm, raw in sorted(self.r.hgetall(P + "saves").items())}

    # ---- base images being sent to a host (`site_images`): one cut short is swept ----------

    def image_copy_started(self, image: str, host: str, base: str) -> None:
        self.r.hset(P + "image-copies", f"{image}@{host}", base)

    def image_copy_ended(self, image: str, host: str) -> None:
        self.r.hdel(P + "image-copies", f"{image}@{host}")

    def image_copies(self) -> dict[str, str]:
        """"image@host" -> the image's base path, for each copy begun and not known ended."""
        return self.r.hgetall(P + "image-copies")

    # ---- what moves teach the deadline planner (`deadline_run.measured_rates`) ---------------

    def learn_move(self, sent_fraction: float, overhead_s: float) -> None:
        """A live migration's share of the VM's memory that went on the wire (untouched pages
        go as zero flags) and its wall time outside QEMU's copy; each a running average in
        which the newest move weighs a quarter."""
        old = self.r.hmget(P + "rates", "sent_fraction", "overhead_s")
        new = [x if not o else 0.75 * float(o) + 0.25 * x
               for x, o in zip((sent_fraction, overhead_s), old)]
        self.r.hset(P + "rates", mapping={"sent_fraction": f"{new[0]:.3f}",
                                          "overhead_s": f"{new[1]:.2f}"})

    # ---- hosts (a snapshot written by reconcile) ---------------------------------------------

    def set_hosts(self, hosts: dict[str, dict]) -> None:
        pipe = self.r.pipeline()
        pipe.delete(P + "hosts")
        if hosts:
            pipe.hset(P + "hosts", mapping={n: json.dumps(h) for n, h in hosts.items()})
        pipe.execute()

    def set_host(self, name: str, snapshot: dict) -> None:
        """One host's entry of the snapshot (a host just added, before any reconcile)."""
        self.r.hset(P + "hosts", name, json.dumps(snapshot))

    def sample_capacity(self, used_mib: int, total_mib: int, every: int = 60) -> bool:
        """The fleet's memory used and total, at most once every `every` seconds (the reconcile
        offers a sample each pass, on every node): a week of minutes is kept."""
        if not self.r.set(CAPACITY + ":gate", "1", nx=True, ex=every):
            return False
        self.r.xadd(CAPACITY, {"time": f"{time.time():.3f}", "used": used_mib,
                               "total": total_mib}, maxlen=CAPACITY_KEPT, approximate=True)
        return True

    def capacity_history(self, since: float) -> list[dict]:
        return [f for _, f in self.r.xrange(CAPACITY, min=int(since * 1000))]

    def hosts(self) -> dict[str, dict]:
        return {n: json.loads(h) for n, h in sorted(self.r.hgetall(P + "hosts").items())}

    # ---- migration attempts ---------------------------------------------------------------

    def add_migration(self, vm: str, record: dict) -> None:
        key = P + f"migrations:{vm}"
        self.r.rpush(key, json.dumps(record, default=str))
        self.r.ltrim(key, -MIGRATIONS_KEPT, -1)

    def migrations(self, vm: str) -> list[dict]:
        return [json.loads(m) for m in self.r.lrange(P + f"migrations:{vm}", 0, -1)]

    # ---- tasks ----------------------------------------------------------------------------

    def add_task(self, task_id: str, name: str, args: dict, queue: str, what: str = "") -> None:
        now = time.time()
        key = P + f"task:{task_id}"
        self.r.hset(key, mapping={
            "id": task_id, "name": name, "args": json.dumps(audit.redacted(args)), "queue": queue,
            "what": what, "submitted": f"{now:.3f}"})
        # A worker may have started it already (it is sent first): its run count stands, and
        # its record is listed, so kept (`task_started` gave it a day when it had no name yet).
        self.r.hsetnx(key, "runs", 0)
        self.r.persist(key)
        self.r.zadd(P + "tasks", {task_id: now})
        for old in self.r.zrange(P + "tasks", 0, -TASKS_KEPT - 1):
            self.r.delete(P + f"task:{old}")
            self.r.zrem(P + "tasks", old)

    def task_started(self, task_id: str, worker: str) -> int:
        """Count a run of the task (a redelivered task runs again); returns which run this is.
        A task not submitted through `add_task` (the beat's reconcile, the passes it queues:
        one every few seconds) is listed nowhere, and its record is kept a day, not for ever."""
        key = P + f"task:{task_id}"
        self.r.hset(key, mapping={"worker": worker, "started": f"{time.time():.3f}"})
        runs = self.r.hincrby(key, "runs", 1)
        if not self.r.hexists(key, "name"):
            self.r.expire(key, UNLISTED_TASK_TTL)
        return runs

    def task_ended(self, task_id: str, outcome: dict) -> None:
        """Record how a task's run ended it (`{"result": ...}` or `{"error": ..., "message":
        ...}`): a redelivered copy of its message answers with this instead of running again."""
        self.r.hset(P + f"task:{task_id}", mapping={"ended": f"{time.time():.3f}",
                                                    "outcome": json.dumps(outcome)})

    def task(self, task_id: str) -> dict:
        return self.r.hgetall(P + f"task:{task_id}")

    def recent_tasks(self, count: int = 20) -> list[dict]:
        ids = self.r.zrevrange(P + "tasks", 0, count - 1)
        return [t for t in (self.task(i) for i in ids) if t]

    # ---- locks ----------------------------------------------------------------------------

    def acquire(self, kind: str, name: str, owner: str, what: str, ttl: int) -> None:
        """Take the lock for `owner` (a task id), or refuse at once saying what holds it.

        Taking a lock the same owner already holds succeeds: a redelivered task keeps its lock.
        """
        key = P + f"lock:{kind}:{name}"
        for _ in range(3):  # a holder that let go between the two calls: take it then
            if self.r.set(key, f"{owner} {what}", nx=True, ex=ttl):
                return
            holder = self.r.get(key)
            if holder is not None:
                break
        else:
            holder = ""
        held_by, _, busy = holder.partition(" ")
        if held_by == owner:
            self.r.expire(key, ttl)
            return
        raise Conflict(f"{'VM' if kind == 'vm' else kind} {name!r} is busy: "
                       f"{busy or 'another operation'} is in progress (task {held_by or '?'})")

    def refresh(self, kind: str, name: str, owner: str, ttl: int) -> bool:
        return bool(self.r.eval(_REFRESH, 1, P + f"lock:{kind}:{name}", owner, ttl))

    def release(self, kind: str, name: str, owner: str) -> None:
        self.r.eval(_RELEASE, 1, P + f"lock:{kind}:{name}", owner)

    def release_owned(self, owner: str) -> int:
        """Give back every lock held in `owner`'s name: its work is over (a task's run ended),
        including steps a dead earlier run of it left holding their VMs. Returns how many."""
        return sum(self.r.eval(_RELEASE, 1, key, owner)
                   for key in self.r.scan_iter(match=P + "lock:*", count=1000))

    def holder(self, kind: str, name: str) -> str | None:
        return self.r.get(P + f"lock:{kind}:{name}")


def _str(value) -> str:
    return value if isinstance(value, str) else json.dumps(value, default=str)
