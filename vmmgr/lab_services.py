"""The lab's control plane: a Redis server, one Celery worker per lab host (inside that host's
network namespace, consuming its own queue and `control`), Celery beat (running reconcile) and
Flower (Celery's own monitor, on the control node's loopback), as the `control` role runs them.

A host's worker sees what a real host's worker sees: its own home at the same path as the control
node's (`VMMGR_HOME`), holding only the files the `vmmgr_worker` role writes there (edge.json,
network.json), with the shared storage mounted at `<home>/storage`. It runs in a mount namespace
of its own where the node's folder (`<home>/lab/nodes/<host>`) is mounted over the home, so the
control node's files (users, keys, the lab's own state) and the other hosts' homes are out of
its sight, as they are on a fleet of separate machines.

Redis listens on the inter-host bridge, as it would on a control node's management address.
Every process started here has the lab's directory on its command line, so `stop` finds them
even after a crash that lost the pid files.
"""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import redis

from .errors import VmmgrError
from .paths import Paths

REDIS_PORT = 6390
RECONCILE_SECONDS = 5  # the lab resumes parked VMs quickly; production's default is 10
VISIBILITY_TIMEOUT = 20  # a dead worker's task comes back after this many seconds
WORKER_THREADS = 6  # a drain, a migration per VM in it, a cancel: all at once
READY_TIMEOUT = 60
# What each site of a multi-site lab has of its own storage, as sites that share none would: its
# VMs' consoles and its saves (images and disks are still the storage's, seen by every site).
SITE_FOLDERS = ("consoles", "saves")
NOTICE_FILE = "notice.json"  # in each host's home: the lab's notice source
FLOWER_PORT = 5555  # Flower's default, on loopback as on a control node (reached by SSH tunnel)


class Services:
    def __init__(self, paths: Paths, bridge_ip: str, log=lambda msg: None):
        self.paths = paths
        self.root = paths.lab / "services"
        self.url = f"redis://{bridge_ip}:{REDIS_PORT}/0"
        self.bridge_ip = bridge_ip
        self.log = log

    def env(self, host: str | None = None) -> dict:
        env = os.environ | {
            "VMMGR_HOME": str(self.paths.home), "VMMGR_REDIS_URL": self.url,
            "VMMGR_RECONCILE_SECONDS": str(RECONCILE_SECONDS),
            "VMMGR_VISIBILITY_TIMEOUT": str(VISIBILITY_TIMEOUT),
        }
        if host:
            env["VMMGR_HOST"] = host
        return env

    # ---- Redis --------------------------------------------------------------------------

    def start_redis(self) -> None:
        if self._alive("redis") and self._pings():
            return
        d = self.root / "redis"
        d.mkdir(parents=True, exist_ok=True)
        conf = d / "redis.conf"
        conf.write_text(
            f"bind {self.bridge_ip}\nport {REDIS_PORT}\nprotected-mode no\n"
            f"dir {d}\nappendonly yes\nsave \"\"\nlogfile {d / 'redis.log'}\n"
            "set-proc-title no\n")  # keep the command line `stop` looks for
        self._spawn("redis", ["redis-server", str(conf)], self.env())
        _until(self._pings, 10, "the lab's Redis did not answer")
        self.paths.redis_url_file.write_text(self.url + "\n")

    def _pings(self) -> bool:
        try:
            return bool(redis.Redis.from_url(self.url, socket_timeout=1).ping())
        except redis.RedisError:
            return False

    # ---- Celery ---------------------------------------------------------------------------

    def node_home(self, host: str) -> Path:
        """Host `host`'s own home, as the control node's folder that its worker sees as
        `VMMGR_HOME` (`worker_log` is in it)."""
        return self.paths.lab / "nodes" / host

    def worker_log(self, host: str) -> Path:
        return self.node_home(host) / "worker.log"

    def write_node_files(self, hosts: list[str]) -> None:
        """What the vmmgr_worker role writes into a host's home: the edge and the guest network.
        Written at every `up`: a repaired lab may have new keys."""
        for host in hosts:
            node = self.node_home(host)
            (node / "storage").mkdir(parents=True, exist_ok=True)
            for name in ("edge.json", "network.json"):
                src = self.paths.home / name
                if src.exists():
                    tmp = node / f".{name}.tmp"
                    tmp.write_bytes(src.read_bytes())
                    os.replace(tmp, node / name)

    def queues_of(self, host: str) -> str:
        """A host's worker's queues, as the vmmgr_worker role's unit names them."""
        site = self.site_of(host)
        return f"host.{host}," + (f"site.{site}," if site else "") + "control"

    def start_workers(self, namespaces: dict[str, str]) -> None:
        """One worker per host (name -> network namespace) that has none running."""
        r = redis.Redis.from_url(self.url, decode_responses=True)
        self.write_node_files(list(namespaces))
        home = str(self.paths.home)
        started = {}
        for host, ns in namespaces.items():
            if self._alive(f"worker-{host}"):
                continue
            r.delete(f"vmmgr:worker:{host}")
            started[host] = self._spawn_on(host, ns, f"worker-{host}", [
                "-m", "celery", "-A", "tasks.app", "worker", "-Q", self.queues_of(host),
                "-n", f"{host}@vmmgr-lab", "--pool", "threads",
                "--concurrency", str(WORKER_THREADS), "--loglevel", "INFO",
                "--logfile", f"{home}/worker.log",  # the node's own home, seen from inside
                "--without-mingle", "--without-gossip"])
        for host, pid in started.items():
            def ready() -> bool:
                if not _running(pid):
                    raise VmmgrError(f"the Celery worker of {host} exited: see "
                                     f"{self.root / f'worker-{host}.out'}")
                return (r.get(f"vmmgr:worker:{host}") or "").split(" ")[0] == str(pid)
            _until(ready, READY_TIMEOUT, f"the Celery worker of {host} did not start: see "
                   f"{self.worker_log(host)}")
        if started:
            self.log(f"celery workers ready: {', '.join(started)}")

    def start_notice_watchers(self, namespaces: dict[str, str]) -> None:
        """Each host's notice watcher, as the kvm_host role's vmmgr-notice unit runs it, on a
        file in the host's own home (`vmmgr lab notice` writes it, as a cloud's notice would)."""
        for host, ns in namespaces.items():
            if not self._alive(f"notice-{host}"):
                self._spawn_on(host, ns, f"notice-{host}", [
                    "-m", "vmmgr.cli", "notice", "watch", "--host", host,
                    "--source", f"file:{self.paths.home / NOTICE_FILE}"])

    def notice_file(self, host: str) -> Path:
        """Where host's watcher looks for a notice, seen from the control node."""
        return self.node_home(host) / NOTICE_FILE

    def site_of(self, host: str) -> str:
        """The site whose storage `host`'s daemons were started seeing (`set_site_of`); "":
        the storage's own."""
        try:
            return (self.paths.lab / "site-of" / host).read_text()
        except FileNotFoundError:
            return ""

    def set_site_of(self, host: str, site: str) -> None:
        (self.paths.lab / "site-of").mkdir(parents=True, exist_ok=True)
        (self.paths.lab / "site-of" / host).write_text(site)

    def site_folders(self, site: str) -> list[tuple[Path, Path]]:
        """(the site's own folder, where its hosts see it) for each of SITE_FOLDERS: what a site
        of the lab has of its own storage; none for "" (the storage's own)."""
        if not site:
            return []
        pairs = [(self.paths.lab / "sites" / site / kind, self.paths.storage / kind)
                 for kind in SITE_FOLDERS]
        for folder, _ in pairs:
            folder.mkdir(parents=True, exist_ok=True)
        return pairs

    def stop_worker(self, host: str) -> None:
        """Stop the host's worker (a warm shutdown: it ends what it runs first, as systemd's
        stop does), e.g. to start it again with another view of the storage."""
        pid = self.worker_pid(host)
        if pid is not None:
            _terminate(pid, 60)

    def stop_notice_watcher(self, host: str) -> None:
        if self._alive(f"notice-{host}"):
            _terminate(self._pid(f"notice-{host}"), 30)

    def _spawn_on(self, host: str, ns: str, name: str, python_args: list[str]) -> int:
        """A Python process of the lab's on `host`: in its network namespace and in a mount
        namespace of its own where the node's folder is the home, with the shared storage in it
        (and its site's own folders in that: `site_folders`)."""
        home, storage, node = str(self.paths.home), str(self.paths.storage), self.node_home(host)
        binds = " ".join(f"{src}:{node / 'storage' / dst.name}"
                         for src, dst in self.site_folders(self.site_of(host)))
        script = ('set -e; mount --bind "$1" "$2/storage"; '
                  'for pair in $4; do mount --bind "${pair%%:*}" "${pair#*:}"; done; '
                  'mount --rbind "$2" "$3"; shift 4; exec "$@"')
        for kind in SITE_FOLDERS:
            (self.paths.storage / kind).mkdir(parents=True, exist_ok=True)
        cmd = ["ip", "netns", "exec", ns, "unshare", "-m", "--propagation", "private",
               "sh", "-c", script, "node-home", storage, str(node), home, binds,
               # -X: the lab's folder on the command line, where `_alive` looks for it
               sys.executable, "-X", f"vmmgr-lab={self.root}", *python_args]
        return self._spawn(name, cmd, self.env(host), cwd=node)

    def start_beat(self) -> None:
        if self._alive("beat"):
            return
        cmd = [sys.executable, "-m", "celery", "-A", "tasks.app", "beat",
               "--schedule", str(self.root / "beat-schedule"), "--loglevel", "INFO",
               "--logfile", str(self.root / "beat.log")]
        self._spawn("beat", cmd, self.env())

    def start_flower(self) -> None:
        """The same command line as the control role's vmmgr-flower unit."""
        if self._alive("flower"):
            return
        cmd = [sys.executable, "-X", f"vmmgr-lab={self.root}", "-m", "celery", "-A", "tasks.app",
               "flower", "--address=127.0.0.1", f"--port={FLOWER_PORT}", "--logging=info"]
        self._spawn("flower", cmd, self.env())

    def start_delay_line(self, spec: dict) -> None:
        """The WAN's latency in user space (lab_delay.py): `spec` has the one-way `delay_ms`,
        `loss_pct` and the `devices` to make (TUN device name -> its host's address), made in
        the root namespace for `Lab` to move into the hosts'. Any earlier line is stopped first:
        its devices, and their routes, go with it."""
        self.stop_delay_line()
        ready = self.root / "delay-line.ready"
        ready.unlink(missing_ok=True)
        cmd = [sys.executable, "-X", f"vmmgr-lab={self.root}", "-m", "vmmgr.lab_delay",
               "--delay-ms", f"{spec['delay_ms']:g}", "--loss-pct", f"{spec['loss_pct']:g}",
               "--ready", str(ready), *(f"{n}={ip}" for n, ip in spec["devices"].items())]
        pid = self._spawn("delay-line", cmd, self.env())
        _until(lambda: ready.exists() or not _running(pid), READY_TIMEOUT,
               "the WAN's delay line did not start")
        if not ready.exists():
            raise VmmgrError(f"the WAN's delay line exited: see {self.root / 'delay-line.out'}")
        (self.root / "delay-line.json").write_text(json.dumps(spec, sort_keys=True))

    def delay_line(self) -> dict | None:
        """The running delay line's spec (None: none runs)."""
        if not self._alive("delay-line"):
            return None
        try:
            return json.loads((self.root / "delay-line.json").read_text())
        except (OSError, ValueError):
            return None

    def delay_line_pid(self) -> int | None:
        return self._pid("delay-line") if self._alive("delay-line") else None

    def stop_delay_line(self) -> None:
        pid = self.delay_line_pid()
        (self.root / "delay-line.json").unlink(missing_ok=True)
        if pid is not None:
            _terminate(pid, 5)
            _until(lambda: not _running(pid), 10, "the WAN's delay line did not stop")

    def worker_pid(self, host: str) -> int | None:
        return self._pid(f"worker-{host}") if self._alive(f"worker-{host}") else None

    def redis_pid(self) -> int | None:
        return self._pid("redis") if self._alive("redis") else None

    # ---- all of it ------------------------------------------------------------------------

    def stop(self) -> None:
        """Stop beat, Flower and Redis (workers go with their host namespaces), found by command
        line."""
        mine = [pid for pid in _pids() if str(self.root) in _cmdline(pid)]
        for pid in mine:
            _signal(pid, signal.SIGTERM)
        deadline = time.monotonic() + 5
        while any(_running(p) for p in mine) and time.monotonic() < deadline:
            time.sleep(0.1)
        for pid in mine:
            _signal(pid, signal.SIGKILL)
        self.paths.redis_url_file.unlink(missing_ok=True)
        subprocess.run(["rm", "-rf", str(self.root)], check=False)

    # ---- processes ----------------------------------------------------------------------

    def _spawn(self, name: str, cmd: list[str], env: dict, cwd: Path | None = None) -> int:
        self.root.mkdir(parents=True, exist_ok=True)
        with open(self.root / f"{name}.out", "ab") as out:
            proc = subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL, stdout=out,
                                    stderr=subprocess.STDOUT, start_new_session=True,
                                    cwd=cwd or self.root)
        (self.root / f"{name}.pid").write_text(f"{proc.pid}\n")
        return proc.pid

    def _pid(self, name: str) -> int | None:
        try:
            return int((self.root / f"{name}.pid").read_text())
        except (OSError, ValueError):
            return None

    def _alive(self, name: str) -> bool:
        pid = self._pid(name)
        return pid is not None and _running(pid) and str(self.root) in _cmdline(pid)


def _until(check, timeout: float, message: str) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise VmmgrError(message)
        time.sleep(0.2)


def _pids() -> list[int]:
    return [int(p) for p in os.listdir("/proc") if p.isdigit()]


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def _running(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


def _terminate(pid: int, grace: float) -> None:
    """SIGTERM, then SIGKILL if it still runs after `grace` seconds."""
    _signal(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace
    while _running(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    _signal(pid, signal.SIGKILL)


def _signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass
