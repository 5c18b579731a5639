"""The lab's PKI and the host configuration it shares with production.

A lab host gets what the `kvm_host` Ansible role gives a real host: a CA certificate and its own
certificate and key under /etc/pki (libvirt's server and client pair, QEMU's migration pair), and
libvirtd.conf / qemu.conf rendered from the role's own templates. The lab adds only what its
namespaces need on top (its listen address, a host UUID of its own, no cgroups or security
driver), so any drift between the lab and `ansible/` shows up here first.

Certificates carry the host's address as an IP subject-alternative name: libvirt's client and
QEMU's migration client check the server's certificate against the address they dialled (gnutls
matches an IP only against an IP SAN). One certificate per host serves as server and client.
"""

import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import jinja2

from .errors import VmmgrError

ROLE_TEMPLATES = Path(__file__).resolve().parent.parent / "ansible" / "roles" / "kvm_host" / "templates"
KEY_BITS = "2048"  # a lab's certificates live as long as the lab


def render_role_template(name: str, **variables) -> str:
    """One of the kvm_host role's templates, rendered as Ansible would for a host."""
    if not (ROLE_TEMPLATES / name).is_file():
        raise VmmgrError(f"the lab renders the kvm_host role's {name}, which is missing from "
                         f"{ROLE_TEMPLATES}: run the lab from a checkout of vmmgr")
    env = jinja2.Environment(loader=jinja2.FileSystemLoader(ROLE_TEMPLATES),
                             undefined=jinja2.StrictUndefined, keep_trailing_newline=True)
    return env.get_template(name).render(ansible_managed="Written by vmmgr lab", **variables)


CLIENT_PKI = "libvirt-pki"  # in a node's home: its libvirt client certificate (`pkipath`)


class LabPKI:
    """A CA under `root`, and certificates signed by it.

    A libvirt client (the control node's CLI, a host's worker) finds its certificate through the
    `pkipath` in the hosts' URIs: `<home>/libvirt-pki`, the same path in every node's home, where
    the control node keeps a client certificate of its own and each host its host certificate
    (as a real host's worker uses the one in its /etc/pki)."""

    def __init__(self, root: Path, home: Path):
        self.root = root
        self.home = home

    @property
    def ca_cert(self) -> Path:
        return self.root / "ca" / "cacert.pem"

    @property
    def ca_key(self) -> Path:
        return self.root / "ca" / "ca-key.pem"

    @property
    def client_dir(self) -> Path:
        """The control node's client certificate, as libvirt's `pkipath` wants it."""
        return self.home / CLIENT_PKI

    @staticmethod
    def install_client(node_home: Path, etc_pki: Path) -> None:
        """A host's own certificate as its node's libvirt client certificate."""
        d = node_home / CLIENT_PKI
        d.mkdir(parents=True, exist_ok=True, mode=0o700)
        for src, name in (("CA/cacert.pem", "cacert.pem"), ("libvirt/clientcert.pem",
                                                             "clientcert.pem"),
                          ("libvirt/private/clientkey.pem", "clientkey.pem")):
            shutil.copy(etc_pki / src, d / name)

    def ensure(self) -> None:
        if not self.ca_cert.exists():
            self.ca_key.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
            _openssl("req", "-x509", "-newkey", f"rsa:{KEY_BITS}", "-nodes",
                     "-keyout", self.ca_key, "-out", self.ca_cert, "-days", "3650",
                     "-subj", "/O=vmmgr lab/CN=vmmgr lab CA",
                     "-addext", "basicConstraints=critical,CA:TRUE",
                     "-addext", "keyUsage=critical,keyCertSign,cRLSign")
            self.ca_key.chmod(0o600)
        if not (self.client_dir / "clientcert.pem").exists():
            self.client_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
            with self._issue("control", None) as (cert, key):  # the certificate last: it is
                shutil.copy(self.ca_cert, self.client_dir / "cacert.pem")  # what is checked for
                shutil.copy(key, self.client_dir / "clientkey.pem")
                shutil.copy(cert, self.client_dir / "clientcert.pem")

    def install_host(self, etc_pki: Path, name: str, ip: str) -> None:
        """The files the kvm_host role installs under /etc/pki, for host `name` at `ip`."""
        with self._issue(name, ip) as (cert, key):
            self._install(etc_pki, cert, key)

    def _install(self, etc_pki: Path, cert: Path, key: Path) -> None:
        layout = {
            "CA/cacert.pem": self.ca_cert,
            "libvirt/servercert.pem": cert, "libvirt/private/serverkey.pem": key,
            "libvirt/clientcert.pem": cert, "libvirt/private/clientkey.pem": key,
            "qemu/ca-cert.pem": self.ca_cert,
            "qemu/server-cert.pem": cert, "qemu/server-key.pem": key,
            "qemu/client-cert.pem": cert, "qemu/client-key.pem": key,
        }
        for rel, src in layout.items():
            dst = etc_pki / rel
            dst.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(src, dst)
            dst.chmod(0o600 if "key" in dst.name else 0o644)
        (etc_pki / "libvirt" / "private").chmod(0o700)

    @contextmanager
    def _issue(self, name: str, ip: str | None) -> Iterator[tuple[Path, Path]]:
        """A key and a certificate for `name` (with `ip` as its SAN), in a scratch folder that
        goes when the caller is done with them, whatever happens."""
        with tempfile.TemporaryDirectory(prefix="vmmgr-pki-") as tmp:
            yield self._sign(Path(tmp), name, ip)

    def _sign(self, scratch: Path, name: str, ip: str | None) -> tuple[Path, Path]:
        key, csr, cert = scratch / "key.pem", scratch / "req.csr", scratch / "cert.pem"
        ext = scratch / "ext.cnf"
        lines = ["basicConstraints=critical,CA:FALSE",
                 "keyUsage=critical,digitalSignature,keyEncipherment",
                 "extendedKeyUsage=serverAuth,clientAuth"]
        if ip:
            lines.append(f"subjectAltName=IP:{ip}")
        ext.write_text("\n".join(lines) + "\n")
        _openssl("req", "-newkey", f"rsa:{KEY_BITS}", "-nodes", "-keyout", key, "-out", csr,
                 "-subj", f"/O=vmmgr lab/CN={ip or name}")
        _openssl("x509", "-req", "-in", csr, "-CA", self.ca_cert, "-CAkey", self.ca_key,
                 "-CAcreateserial", "-CAserial", self.root / "ca" / "serial", "-days", "825",
                 "-extfile", ext, "-out", cert)
        return cert, key


def _openssl(*args) -> None:
    proc = subprocess.run(["openssl", *map(str, args)], capture_output=True, text=True,
                          stdin=subprocess.DEVNULL)
    if proc.returncode != 0:
        raise VmmgrError(f"openssl {args[0]}: {proc.stderr.strip()[-400:]}")
