"""Where vmmgr keeps its files on a node.

One root (`VMMGR_HOME`, default /var/lib/vmmgr). `storage` must be the same path on every host
(shared storage in production). Everything about the fleet that more than one node must agree
on (hosts and their states, locks, records) lives in the fleet's store, Redis, not here.
"""

import os
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Paths:
    home: Path

    @property
    def storage(self) -> Path:
        return self.home / "storage"

    @property
    def images(self) -> Path:
        """Kernels, initrds and disks that VMs may boot from; nothing outside it is accepted."""
        return self.storage / "images"

    @property
    def consoles(self) -> Path:
        return self.storage / "consoles"

    @property
    def saves(self) -> Path:
        """Suspended VMs: one folder each (save image, definition, record)."""
        return self.storage / "saves"

    @property
    def lab(self) -> Path:
        return self.home / "lab"

    @property
    def network_config(self) -> Path:
        return self.home / "network.json"

    @property
    def redis_url_file(self) -> Path:
        """Where `lab up` (or an operator) writes the Redis URL when $VMMGR_REDIS_URL is unset."""
        return self.home / "redis.url"

    @property
    def users(self) -> Path:
        """The web console's users, their password hashes and API token hashes (mode 0600)."""
        return self.home / "users.json"

    @property
    def web_secret(self) -> Path:
        """The key that signs the web console's session cookies (mode 0600)."""
        return self.home / "web-secret"

    def redis_url(self) -> str | None:
        """The task broker and fleet-state store, or None if none is configured."""
        url = os.environ.get("VMMGR_REDIS_URL")
        if url:
            return url
        try:
            return self.redis_url_file.read_text().strip() or None
        except OSError:
            return None


LAB_HOME = Path("/var/lib/vmmgr-lab")


def default_paths() -> Paths:
    return Paths(Path(os.environ.get("VMMGR_HOME", "/var/lib/vmmgr")))


def lab_paths() -> Paths:
    """The local lab's home: its own, never a real fleet's default (`VMMGR_HOME` still wins, and
    `lab up` refuses a home that belongs to another fleet's store)."""
    return Paths(Path(os.environ.get("VMMGR_HOME") or LAB_HOME))
