"""The Ansible playbooks: lint at the production profile, syntax, and a real apply.

The apply runs `site.yml` against two Debian 12 trees made with debootstrap (a KVM host that is
also the control node, and an edge), reached with the chroot connection. Services are not
started there (there is no init to talk to), everything else is real: packages installed with
apt, files rendered from the inventory, units enabled, keys generated. A second run must report
no change.
"""

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

import vmmgr
from vmmgr.apt_sources import debian_mirror
from vmmgr.errors import VmmgrError

ROOT = Path(__file__).resolve().parents[2]
ANSIBLE_DIR = ROOT / "ansible"
BIN = Path(sys.executable).parent
# A Debian 12 server's base (with systemd, as a real host has), debootstrapped once per machine.
BASE_PACKAGES = "python3,ca-certificates,systemd"
BASE = Path(f"/var/cache/vmmgr-test/bookworm-{BASE_PACKAGES.replace(',', '-')}")


def machine_debian_mirror() -> str:
    """The mirror this machine's apt takes Debian bookworm from: the trees come from there."""
    try:
        return debian_mirror("bookworm")
    except VmmgrError as err:
        pytest.fail(str(err))


ARTIFACTS = ROOT / "tests" / "artifacts"  # the playbook runs' output, kept for reading
# What this machine needs to reach the package registries (pip's local wheel sources and
# settings, the CA bundle that may hold a proxy's CA) reaches into the trees too, if present.
HOST_PIP = [Path("/opt/wheels"), Path("/opt/pypi"), Path("/opt/pypi-more"), Path("/etc/xdg/pip"),
            Path("/etc/pip.conf"), Path("/etc/ssl/certs/ca-certificates.crt")]


def run(cmd, **kw):
    return subprocess.run(cmd, capture_output=True, text=True, **kw)


def test_lint_is_clean_at_the_production_profile():
    proc = run([str(BIN / "ansible-lint"), "--profile", "production", "--nocolor"],
               cwd=ANSIBLE_DIR, env=os.environ | {"PATH": f"{BIN}:{os.environ['PATH']}"})
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_every_playbook_passes_the_syntax_check():
    for playbook in sorted(ANSIBLE_DIR.glob("*.yml")):
        proc = run([str(BIN / "ansible-playbook"), "--syntax-check", playbook.name],
                   cwd=ANSIBLE_DIR)
        assert proc.returncode == 0, proc.stdout + proc.stderr


def test_a_control_node_that_is_no_kvm_host_mounts_the_shared_storage(tmp_path):
    """The admin CLI on the control node imports and lists the VM images and reads the saves on
    the shared storage, as the lab's control node sees it: a control node apart from the KVM
    hosts mounts it too (the apply below has one node in both groups)."""
    inventory = tmp_path / "hosts.json"
    inventory.write_text(json.dumps({"all": {"children": {
        "kvm_hosts": {"hosts": {"host1": {}}}, "control": {"hosts": {"control1": {}}},
        "edge": {"hosts": {"edge1": {}}}}}}))
    proc = run([str(BIN / "ansible-playbook"), "-i", str(inventory), "--list-tasks",
                "site.yml"], cwd=ANSIBLE_DIR)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    plays = {m.group(1): m.group(2) for m in re.finditer(
        r"^  play #\d+ \(([^)]*)\):.*\n((?:    .*\n?)*)", proc.stdout, re.M)}
    for hosts in ("control", "kvm_hosts"):
        assert "Mount the shared storage" in plays[hosts], proc.stdout
    assert "Mount the shared storage" not in plays["edge"]


def test_the_lab_settings_never_reach_production():
    text = "\n".join(p.read_text() for p in ANSIBLE_DIR.rglob("*") if p.is_file())
    assert "listen_tcp = 1" not in text and 'auth_tcp = "none"' not in text


@pytest.fixture(scope="module")
def trees(tmp_path_factory):
    if os.geteuid() != 0:
        pytest.fail("the apply test runs as root (debootstrap, chroot)")
    if not (BASE / "usr/bin/python3").exists():
        shutil.rmtree(BASE, ignore_errors=True)
        BASE.parent.mkdir(parents=True, exist_ok=True)
        proc = run(["debootstrap", "--variant=minbase", f"--include={BASE_PACKAGES}",
                    "bookworm", str(BASE), machine_debian_mirror()])
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    root = tmp_path_factory.mktemp("targets")
    made, mounts = {}, []
    try:
        for name in ("host1", "edge1"):
            tree = root / name
            assert run(["cp", "-a", str(BASE), str(tree)]).returncode == 0
            shutil.copy("/etc/resolv.conf", tree / "etc/resolv.conf")
            policy = tree / "usr/sbin/policy-rc.d"  # packages' scripts start no services here
            policy.write_text("#!/bin/sh\nexit 101\n")
            policy.chmod(0o755)
            mounts.append(_mount(["-t", "proc", "proc"], tree / "proc"))
            for src in HOST_PIP:
                if src.exists():
                    mounts.append(_mount(["--bind", "-o", "ro"] if src.is_dir() else ["--bind"],
                                         tree / src.relative_to("/"), src))
            made[name] = tree
        yield made
    finally:
        for target in reversed(mounts):
            subprocess.run(["umount", "-l", str(target)], check=False)
        shutil.rmtree(root, ignore_errors=True)


def _mount(opts, target: Path, src: Path | None = None) -> Path:
    if src is not None and src.is_file():
        target.parent.mkdir(parents=True, exist_ok=True)
        target.touch()
    else:
        target.mkdir(parents=True, exist_ok=True)
    subprocess.run(["mount", *opts, *([str(src)] if src else []), str(target)], check=True)
    return target


def _pki(d: Path) -> None:
    d.mkdir(parents=True)
    ssl = ["openssl"]
    run(ssl + ["req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj",
               "/CN=vmmgr test CA", "-keyout", str(d / "ca-key.pem"), "-out",
               str(d / "cacert.pem")], check=True)
    for host in ("host1", "edge1"):
        run(ssl + ["req", "-newkey", "rsa:2048", "-nodes", "-subj", f"/CN={host}", "-keyout",
                   str(d / f"{host}-key.pem"), "-out", str(d / f"{host}.csr")], check=True)
        run(ssl + ["x509", "-req", "-in", str(d / f"{host}.csr"), "-CA", str(d / "cacert.pem"),
                   "-CAkey", str(d / "ca-key.pem"), "-CAcreateserial", "-days", "2", "-out",
                   str(d / f"{host}-cert.pem")], check=True)


def _inventory(path: Path, trees: dict, pki: Path, wheel: str) -> None:
    """The example's group_vars with this test's few changes, and the two trees as hosts."""
    group_vars = yaml.safe_load((ANSIBLE_DIR / "inventory/example/group_vars/all.yml").read_text())
    group_vars |= {
        "ansible_connection": "community.general.chroot",
        "ansible_python_interpreter": "/usr/bin/python3",
        "vmmgr_manage_services": False, "vmmgr_storage_mount_now": False,
        "vmmgr_package": wheel,
        "vmmgr_tls_ca_cert": str(pki / "cacert.pem"),
        "vmmgr_tls_cert": str(pki / "{{ inventory_hostname }}-cert.pem"),
        "vmmgr_tls_key": str(pki / "{{ inventory_hostname }}-key.pem"),
    }
    (path.parent / "group_vars").mkdir()
    (path.parent / "group_vars" / "all.yml").write_text(json.dumps(group_vars))
    inventory = {"all": {
        "children": {
            "kvm_hosts": {"hosts": {"host1": {"ansible_host": str(trees["host1"]),
                                              "vmmgr_address": "192.0.2.11",
                                              "vmmgr_wg_address": "10.79.0.11"}}},
            "control": {"hosts": {"host1": {}}},
            "edge": {"hosts": {"edge1": {"ansible_host": str(trees["edge1"]),
                                         "vmmgr_address": "192.0.2.1",
                                         "vmmgr_wg_address": "10.79.0.1",
                                         "vmmgr_edge_outside_interface": "eth1"}}},
        }}}
    path.write_text(json.dumps(inventory))


def _play(inventory: Path) -> subprocess.CompletedProcess:
    return run([str(BIN / "ansible-playbook"), "-i", str(inventory), "site.yml"],
               cwd=ANSIBLE_DIR,
               env=os.environ | {"ANSIBLE_NOCOLOR": "1", "PATH": f"{BIN}:{os.environ['PATH']}"},
               timeout=1800)


def _unit_file(tree: Path, link: Path) -> Path:
    """Where an enablement link points, inside the tree (links may be absolute or relative)."""
    target = os.readlink(link)
    return tree / target.lstrip("/") if target.startswith("/") else link.parent / target


def _recap(out: str) -> dict[str, dict[str, int]]:
    recap = {}
    for host, fields in re.findall(r"^(\S+)\s+:\s+(ok=.*)$", out, re.M):
        recap[host] = {k: int(v) for k, v in re.findall(r"(\w+)=(\d+)", fields)}
    return recap


@pytest.mark.timeout(2400)  # two runs of apt and pip into fresh trees
def test_site_yml_sets_up_a_host_and_an_edge_and_a_second_run_changes_nothing(trees, tmp_path):
    pki = tmp_path / "pki"
    _pki(pki)
    wheel_dir = trees["host1"] / "tmp/wheels"
    proc = run([str(BIN / "pip"), "wheel", "--no-deps", "-q", "-w", str(wheel_dir), str(ROOT)])
    assert proc.returncode == 0, proc.stderr
    wheel = "/tmp/wheels/" + next(wheel_dir.glob("vmmgr-*.whl")).name
    (tmp_path / "inventory").mkdir()
    inventory = tmp_path / "inventory" / "hosts.json"
    _inventory(inventory, trees, pki, wheel)

    first = _play(inventory)
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    (ARTIFACTS / "site-first-run.log").write_text(first.stdout + first.stderr)
    assert first.returncode == 0, first.stdout[-6000:] + first.stderr[-3000:]
    host, edge = trees["host1"], trees["edge1"]

    # Packages present.
    for tree, packages in ((host, ["libvirt-daemon-system", "qemu-system-x86",
                                   "wireguard-tools", "redis-server"]),
                           (edge, ["wireguard-tools", "nftables"])):
        for p in packages:
            assert run(["chroot", str(tree), "dpkg-query", "-W", "-f=${Status}", p]).stdout \
                == "install ok installed", p

    # Files rendered with the inventory's values; TLS only.
    libvirtd = (host / "etc/libvirt/libvirtd.conf").read_text()
    assert "listen_tls = 1" in libvirtd and "listen_tcp = 0" in libvirtd
    qemu = (host / "etc/libvirt/qemu.conf").read_text()
    assert "migrate_tls_force = 1" in qemu and 'migration_host = "192.0.2.11"' in qemu
    assert (host / "etc/pki/libvirt/private/serverkey.pem").stat().st_mode & 0o777 == 0o600
    assert os.access(host / "etc/libvirt/hooks/qemu", os.X_OK)
    assert "VMMGR_HOST=host1" in (host / "etc/vmmgr/vmmgr.env").read_text()
    # the host's TCP for moves across a WAN, as the lab sets it (vmmgr.lab.HOST_SYSCTLS)
    sysctls = (host / "etc/sysctl.d/50-vmmgr.conf").read_text()
    assert "net.ipv4.tcp_congestion_control=bbr" in sysctls.replace(" ", ""), sysctls
    assert (host / "etc/modules-load.d/vmmgr-bbr.conf").read_text() == "tcp_bbr\n"
    assert "nfs.example.net:/export/vmmgr" in (host / "etc/fstab").read_text()
    assert "bind 127.0.0.1 192.0.2.11" in (host / "etc/redis/redis.conf").read_text()
    assert "10.78.0.0/24" in (edge / "etc/nftables.conf").read_text()
    # Guests are kept off the management network: on the host, and out of the tunnels at the edge.
    guest_fw = (host / "etc/vmmgr/guest-firewall.nft").read_text()
    assert 'iifname "br-guest" oifname { "br-guest", "wg0" } accept' in guest_fw
    assert guest_fw.count('iifname "br-guest" drop') == 2  # forward and input
    edge_fw = (edge / "etc/nftables.conf").read_text()
    assert 'iifname "wg0" oifname { "eth1", "wg0", "vmhold" } accept' in edge_fw
    assert 'iifname "vmhold-out" notrack' in edge_fw
    assert 'iifname "wg0" drop' in edge_fw

    # WireGuard: each side has its own root-only key and the other's public key.
    def pub(tree):
        key = (tree / "etc/wireguard/private.key")
        assert key.stat().st_mode & 0o777 == 0o600
        return run(["wg", "pubkey"], input=key.read_text()).stdout.strip()

    host_conf = (host / "etc/wireguard/wg0.conf").read_text()
    edge_conf = (edge / "etc/wireguard/wg0.conf").read_text()
    assert f"PublicKey = {pub(edge)}" in host_conf and "Endpoint = 192.0.2.1:51820" in host_conf
    assert f"PublicKey = {pub(host)}" in edge_conf and "AllowedIPs = 10.79.0.11/32" in edge_conf
    assert "PrivateKey" not in host_conf + edge_conf

    # Where vmmgr finds the edge: its tunnels' public keys, reached over SSH.
    edge_json = json.loads((host / "var/lib/vmmgr/edge.json").read_text())
    assert edge_json["peers"]["host1"] == {"public_key": pub(host), "tunnel_ip": "10.79.0.11",
                                           "endpoint": "192.0.2.11:51820"}
    assert edge_json["command"][0] == "ssh" and edge_json["command"][-1] == "root@192.0.2.1"
    # The edge holds a VM's packets through its switch-over with the script the lab runs.
    assert edge_json["hold_interface"] == "vmhold"
    assert (edge / "usr/local/sbin/vmmgr-edge-hold").read_bytes() == (
        Path(vmmgr.__file__).parent / "host_files/edge-hold.sh").read_bytes()
    assert json.loads((host / "var/lib/vmmgr/network.json").read_text()) == {
        "pool": "10.78.0.0/24", "gateway": "10.78.0.1", "bridge": "br-guest"}

    # Units enabled: systemctl's links inside the tree, pointing at unit files inside it.
    def enabled(tree, unit):  # wanted by whatever target its [Install] names
        # (A literal last component in glob() would skip links dangling outside the tree.)
        links = [p for p in (tree / "etc/systemd/system").glob("*.wants/*") if p.name == unit]
        return bool(links) and all(_unit_file(tree, link).is_file() for link in links)

    def wants(tree):
        return sorted(str(p.relative_to(tree)) for p in (tree / "etc/systemd/system").glob("*.wants/*"))

    for unit in ("vmmgr-worker.service", "vmmgr-beat.service", "vmmgr-flower.service",
                 "vmmgr-notice.service", "wg-quick@wg0.service",
                 "redis-server.service", "systemd-networkd.service"):
        assert enabled(host, unit), f"{unit} not enabled; links: {' '.join(wants(host))}"
    assert enabled(host, "libvirtd-tls.socket") and enabled(host, "vmmgr-guest-firewall.service")
    assert enabled(edge, "nftables.service") and enabled(edge, "wg-quick@wg0.service"), wants(edge)
    assert enabled(edge, "vmmgr-edge-hold.service"), wants(edge)

    # The worker's virtualenv really holds vmmgr, its task API and Flower's.
    proc = run(["chroot", str(host), "/opt/vmmgr/venv/bin/python", "-c",
                "import vmmgr.fleet, tasks.ops, flower.command"])
    flower_unit = (host / "etc/systemd/system/vmmgr-flower.service").read_text()
    assert "--address=127.0.0.1" in flower_unit, flower_unit  # loopback only, as in the lab
    notice_unit = (host / "etc/systemd/system/vmmgr-notice.service").read_text()
    # the same watcher and source the lab runs: a file in the host's home
    assert 'notice watch --host host1 --source "file:/var/lib/vmmgr/notice.json"' in notice_unit
    assert proc.returncode == 0, proc.stderr

    second = _play(inventory)
    (ARTIFACTS / "site-second-run.log").write_text(second.stdout + second.stderr)
    assert second.returncode == 0, second.stdout[-4000:]
    recap = _recap(second.stdout)
    assert recap["host1"]["changed"] == 0 and recap["edge1"]["changed"] == 0, second.stdout[-4000:]
