"""Saves stay on the storage of the site they were made in (issue 18): only that site's nodes read
a save's folder, change it or take it for gone; requests that act on one are queued to that site's
workers; a VM with a writable disk on its site's storage resumes only there."""

import json
import shlex
from pathlib import Path
from types import SimpleNamespace

import jinja2
import pytest

from tasks.app import CONTROL_QUEUE, queue_for
from vmmgr import local_disks, metrics, reclaim, requests, suspend
from vmmgr.errors import Conflict
from vmmgr.lab_services import Services
from vmmgr.locks import Lease
from vmmgr.paths import Paths
from vmmgr.state import FleetState

from .saves_fleet import SavesFleet

RECORD = {"vm": "a", "from_host": "h1", "memory_mib": 128, "vcpus": 1, "suspended_at": 1.0,
          "save_ms": 10, "image_bytes": 4096, "parked": True, "site": "east"}
DOMAIN = "<domain><name>a</name><devices/></domain>"
SITES = {"h1": "east", "h2": "east", "h3": "west"}


def saved(site: str, vm: str = "a", **more) -> dict:
    return {"state": "saved", "intent": {}, "address": "", "disk": False,
            "record": dict(RECORD, vm=vm, site=site, **more)}


@pytest.fixture
def node(tmp_path, redis_url, monkeypatch):
    """A worker of h1 (site east), seeing east's storage."""
    monkeypatch.setenv("VMMGR_HOST", "h1")
    state = FleetState(redis_url)
    (tmp_path / "saves").mkdir()
    return SavesFleet(paths=SimpleNamespace(saves=tmp_path / "saves",
                                            storage=tmp_path),
                      state=state, site_of=dict(SITES),
                      lock_vm=lambda vm, what: Lease(state, "vm", vm, "test", what))


def test_a_save_is_on_the_site_it_was_made_in(node):
    assert node.own_site() == "east"
    assert node.save_site(saved("west")) == "west" and node.save_site(None) is None
    old = saved("")  # a copy written before saves named their site: on the one storage
    del old["record"]["site"]  # of a fleet that named none, whichever site its host is in now
    assert node.save_site(old) == ""
    assert node.save_site({"state": "saving", "record": None,
                           "intent": {"from_host": "h1", "site": "west"}}) == "west"


def test_a_node_never_forgets_another_sites_save_and_keeps_its_own_in_step(node):
    node.state.put_save("far", saved("west", vm="far"))  # its folder is on west's storage
    node.state.put_save("gone", saved("east", vm="gone"))  # east's, its folder removed
    d = node.paths.saves / "here"
    d.mkdir()
    (d / "domain.xml").write_text(DOMAIN)
    (d / "record.json").write_text(json.dumps(dict(RECORD, vm="here")))
    changed = suspend.sync_records(node)
    assert changed == ["gone", "here"]
    assert node.state.save_of("far") == saved("west", vm="far")
    assert node.state.save_of("gone") is None
    assert node.state.save_of("here")["record"]["vm"] == "here"
    suspend.sync_record(node, "far")  # after a step on it, by mistake, here: nothing
    assert node.state.save_of("far") == saved("west", vm="far")


def test_a_save_from_before_saves_named_their_site_is_the_site_whose_storage_holds_it(node):
    """Left stopped otherwise: no site's node would take it for its own."""
    old = {k: v for k, v in RECORD.items() if k != "site"}
    d = node.paths.saves / "old"
    d.mkdir()
    (d / "domain.xml").write_text(DOMAIN)
    (d / "record.json").write_text(json.dumps(dict(old, vm="old")))
    node.state.put_save("old", suspend.folder_save(d))  # as the old code copied it
    assert node.save_site(node.state.save_of("old")) == "" and not node.sees_save("old")
    assert suspend.sync_records(node) == ["old"]
    assert json.loads((d / "record.json").read_text())["site"] == "east"
    assert node.state.save_of("old") == suspend.folder_save(d)
    assert node.sees_save("old") and suspend.sync_records(node) == []
    # a folder of that name with no site, where the store names another site's save: not it
    (d / "record.json").write_text(json.dumps(dict(old, vm="old")))
    node.state.put_save("old", saved("west", vm="old"))
    assert suspend.sync_records(node) == []
    assert node.state.save_of("old") == saved("west", vm="old")
    assert "site" not in json.loads((d / "record.json").read_text())
    node.site_of = {}  # a fleet that names no site: its saves name none, and stay so
    d2 = node.paths.saves / "plain"
    d2.mkdir()
    (d2 / "record.json").write_text(json.dumps(dict(old, vm="plain")))
    assert suspend.sync_records(node) == ["plain"]
    assert "site" not in json.loads((d2 / "record.json").read_text())


def test_what_acts_on_another_sites_save_is_refused_here(node):
    node.state.put_save("far", saved("west", vm="far"))
    assert not node.sees_save("far") and node.sees_save("none")
    with pytest.raises(Conflict, match="storage of site west, which this node does not see: "
                                       "its resume runs there"):
        node.require_save_here("far", "resume")
    node.require_save_here("none", "resume")  # no save: nothing to refuse
    with pytest.raises(Conflict, match="site west"):
        suspend._resume_held(node, "far", None, None)  # before it reads anything
    # and a save is written only by a node of its host's site
    node.require_own_site("h2", "the suspend of a")
    with pytest.raises(Conflict, match="writes on the storage of site west"):
        node.require_own_site("h3", "the suspend of b")


def test_a_save_begun_on_another_site_counts_as_suspended_here(node):
    """A worker killed there after the host let the VM go, its copy still "saving": only its
    site can tell how it ends, and until then no other node takes the VM for gone."""
    from vmmgr.fleet import Fleet
    node.state.put_save("far", {"state": "saving", "record": None, "address": "",
                                "disk": False, "intent": {"vm": "far", "site": "west"}})
    assert Fleet.is_suspended(node, "far")
    node.state.put_save("near", {"state": "saving", "record": None, "address": "",
                                 "disk": False, "intent": {"vm": "near", "site": "east"}})
    assert not Fleet.is_suspended(node, "near")  # its folder, here, says: no record yet


def test_the_disk_kept_with_another_sites_save_is_known_by_the_stores_copy(node):
    from vmmgr.fleet import Fleet
    node.is_saved_whole = lambda vm: Fleet.is_saved_whole(node, vm)
    node.state.put_save("far", saved("west", vm="far") | {"disk": True})
    node.state.put_save("half", saved("west", vm="half") | {"disk": True, "state": "saving"})
    assert Fleet.disk_kept_with_save(node, "far")
    assert not Fleet.disk_kept_with_save(node, "half")


def test_requests_on_a_save_go_to_its_sites_workers(mocker):
    fleet = mocker.Mock()
    fleet.save_site.side_effect = lambda save: save and save["record"]["site"]
    fleet.state.save_of.side_effect = {"far": saved("west", vm="far"),
                                       "plain": saved("", vm="plain")}.get
    fleet.sites.return_value = SITES
    mocker.patch.object(requests.admission, "suspended_vm")
    mocker.patch.object(requests.admission, "destroyable")
    mocker.patch.object(requests.admission, "known_host")
    req = requests.resume(fleet, "far", "h1")  # a host of another site: still run in west
    assert (req.host, req.site, req.kwargs) == (None, "west", {"vm": "far", "host": "h1"})
    assert queue_for(req.host, req.site) == "site.west"
    req = requests.resume(fleet, "plain", "h1")  # a fleet naming no site: on the target
    assert queue_for(req.host, req.site) == "host.h1"
    assert queue_for(None, requests.destroy(fleet, "far").site) == "site.west"
    assert queue_for(None, requests.destroy(fleet, "running").site) == CONTROL_QUEUE
    reclaim_req = requests.evacuate(fleet, "h3", deadline=True)  # its saves are west's
    assert queue_for(reclaim_req.host, reclaim_req.site) == "site.west"
    drain = requests.evacuate(fleet, "h1", deadline=False)  # it may hibernate one: a save
    assert queue_for(drain.host, drain.site) == "site.east"


def test_a_vm_with_a_disk_on_its_sites_storage_resumes_only_there(tmp_path):
    xml = ("<domain><devices>"
           f"<disk><source file='{tmp_path}/disks/a-swap.img'/><target dev='vdb'/></disk>"
           f"<disk><source file='{tmp_path}/images/os/d/disk.qcow2'/><readonly/></disk>"
           "<disk><source file='/var/lib/libvirt/vmmgr-disks/a.qcow2'/></disk>"
           "<disk><source file='/var/lib/libvirt/vmmgr-disks/a-seed.iso'/><readonly/></disk>"
           "<disk type='network'><source protocol='nbd'/></disk>"
           "</devices></domain>")
    assert local_disks.site_bound(xml, tmp_path) == [f"{tmp_path}/disks/a-swap.img"]
    assert local_disks.site_bound("<domain><devices/></domain>", tmp_path) == []
    # a local-disk VM made before its seed moved with its disk: its seed, read-only, is on
    # its site's storage, which another site's lacks (the review's finding)
    old = ("<domain><devices>"
           "<disk><source file='/var/lib/libvirt/vmmgr-disks/a.qcow2'/></disk>"
           f"<disk><source file='{tmp_path}/disks/a-seed.iso'/><readonly/></disk>"
           "</devices></domain>")
    assert local_disks.site_bound(old, tmp_path) == [f"{tmp_path}/disks/a-seed.iso"]


def test_a_vm_with_a_disk_on_its_sites_storage_never_moves_to_another_site(node, mocker):
    """Another site's storage lacks the disk, or holds another VM's of the same name: the move
    is refused before anything runs, and a reclaim's plan keeps the VM in its site (saved there
    when its site has no room)."""
    from vmmgr.host import Capacity
    from vmmgr.reclaim import VMSize, plan_evacuation
    shared = (f"<domain><devices><disk><source file='{node.paths.storage}/disks/a.qcow2'/>"
              "</disk></devices></domain>")
    node.require_site_holds("a", shared, "h1", "h2")  # inside its site
    node.require_site_holds("a", DOMAIN, "h1", "h3")  # nothing on the site's storage
    with pytest.raises(Conflict, match=r"a moves only inside its site \(east\), not to h3 in "
                       r"site west: .*/disks/a.qcow2 is on its site's storage"):
        node.require_site_holds("a", shared, "h1", "h3")
    # the fleet view's row names that disk, so a request is refused before it is queued
    from vmmgr import view
    from vmmgr.fleet import VMInfo
    row = view.guest_row(VMInfo("a", "h1", "running", 128, 1, "", site_disk="/s/disks/a.qcow2"))
    assert row["site_disk"] == "/s/disks/a.qcow2"
    assert "site_disk" not in view.guest_row(VMInfo("b", "h1", "running", 128, 1, ""))
    with pytest.raises(Conflict, match="a moves only inside its site"):
        node.require_disk_reaches("a", row["site_disk"], row["host"], "h3")
    node.require_disk_reaches("a", row["site_disk"], row["host"], "h2")
    node.require_disk_reaches("b", "", "h1", "h3")
    room = {"h2": Capacity(1024, 4, 900, 0, ()), "h3": Capacity(4096, 8, 0, 0, ())}
    vms = [VMSize("bound", 512, 1, site_bound=True), VMSize("free", 512, 1)]
    steps = {s.vm: s for s in plan_evacuation(vms, room, True, SITES, "h1")}
    assert (steps["free"].action, steps["free"].target) == ("migrate", "h3")
    assert (steps["bound"].action, steps["bound"].target) == ("suspend", None)
    assert steps["bound"].reason.startswith("no room (its disk on site east's storage keeps it "
                                            "there; h2: needs 512 MiB")
    room["h2"] = Capacity(1024, 4, 0, 0, ())
    steps = {s.vm: s for s in plan_evacuation(vms, room, True, SITES, "h1")}
    assert (steps["bound"].action, steps["bound"].target) == ("migrate", "h2")
    # a fleet that names no site: every host is the one storage's
    steps = {s.vm: s for s in plan_evacuation(vms, room, True, {}, "h1")}
    assert steps["bound"].target == "h3"
    [step] = plan_evacuation(vms[:1], {}, True, {}, "h1")
    assert step.reason == "no room (no other active host)"


def test_a_sites_pass_resumes_only_its_own_parked_vms(node, mocker):
    node.state.put_save("near", saved("east", vm="near"))
    node.state.put_save("far", saved("west", vm="far"))
    cap = SimpleNamespace()
    node.active_capacities = lambda: {"h2": cap}
    mocker.patch.object(reclaim, "place_together", side_effect=lambda caps, members, *a:
                        ["h2"] * len(members))
    resumed = mocker.patch.object(reclaim.operations, "resume")
    assert reclaim.resume_parked(node, SimpleNamespace(event=print), synced=True) == ["near"]
    assert [c.args[2:] for c in resumed.call_args_list] == [("near", "h2")]


def test_a_worker_takes_its_sites_queue_in_the_lab_as_the_role_names_it(tmp_path):
    services = Services(Paths(tmp_path), "10.0.0.1")
    services.set_site_of("host3", "west")
    template = (Path(__file__).parents[2] / "ansible/roles/vmmgr_worker/templates"
                / "vmmgr-worker.service.j2")
    for host, site in (("host3", "west"), ("host1", "")):
        unit = jinja2.Template(template.read_text()).render(
            ansible_managed="managed", inventory_hostname=host, vmmgr_worker_venv="/opt/v",
            vmmgr_worker_threads=6, vmmgr_worker_site=site)
        [line] = [row for row in unit.splitlines() if row.startswith("ExecStart=")]
        args = shlex.split(line.removeprefix("ExecStart="))
        assert args[args.index("-Q") + 1] == services.queues_of(host)
    assert services.queues_of("host3") == "host.host3,site.west,control"
    assert [dst.name for _, dst in services.site_folders("west")] == ["consoles", "saves"]
    assert services.site_folders("") == []


def test_one_pass_over_a_sites_saves_at_a_time(node, mocker):
    """The reconcile's own pass over its node's site and the one it queued there earlier never
    run at once: each could place a parked VM in one host's last room."""
    from vmmgr import reconcile
    node.owner = "pass-2"
    synced = mocker.patch.object(reconcile.suspension, "sync_records", return_value=[])
    mocker.patch.object(reconcile, "recover_cut_short", return_value=["b: finished"])
    mocker.patch.object(reconcile.reclaim, "resume_parked", return_value=["a"])
    with Lease(node.state, "fleet", "reconcile-saves:east", "pass-1", "pass over site east's"):
        assert reconcile.reconcile_saves(node, None)["skipped"].startswith("another pass")
        assert not synced.called
    assert reconcile.reconcile_saves(node, None) == {"repaired": [], "recovered": ["b: finished"],
                                                     "resumed": ["a"]}
    assert node.state.holder("fleet", "reconcile-saves:east") is None
    # what a site's pass did counts in the fleet's metrics, wherever it ran
    assert metrics.read(node.state.r)[("reconcile_recoveries",)] == 1


def test_a_worker_not_started_on_its_sites_queue_takes_it_up(redis_url, monkeypatch):
    """A host's site is recorded by `host add --site`; its worker's queues by the role's
    `vmmgr_worker_site`. Where they disagree (a setting missed), the worker consumes the queue the
    inventory names, or the site's resumes and reclaims would wait there for ever."""
    from tasks import runtime
    from vmmgr.inventory import HostRecord, Inventory
    monkeypatch.setattr(runtime, "state", lambda: FleetState(redis_url))
    Inventory(FleetState(redis_url).r).add(HostRecord("h3", "qemu+tls://h3/system",
                                                      site="west"))
    added, consumed = [], set()
    consumer = SimpleNamespace(
        task_consumer=SimpleNamespace(consuming_from=lambda q: q in consumed),
        add_task_queue=lambda q: (added.append(q), consumed.add(q)))
    monkeypatch.setenv("VMMGR_HOST", "h3")
    runtime._consume_own_sites_queue(consumer)
    runtime._consume_own_sites_queue(consumer)  # started on it: nothing more
    assert added == ["site.west"]
    monkeypatch.setenv("VMMGR_HOST", "elsewhere")  # a worker the inventory does not name
    runtime._consume_own_sites_queue(consumer)
    assert added == ["site.west"]


def test_a_worker_running_before_its_host_was_added_to_a_site_takes_up_its_queue(redis_url,
                                                                                  mocker):
    """The worker checks the inventory when it starts: one already running when `host add
    --site` records its host is told to consume the site's queue then."""
    from tasks import ops
    mocker.patch.object(ops, "state", lambda: FleetState(redis_url))
    told = mocker.patch.object(ops.app.control, "add_consumer")
    ops._site_queue_to_its_worker("h3", "west")  # no worker started there yet: at its start
    assert not told.called
    FleetState(redis_url).r.set("vmmgr:worker:h3", "4242 h3@node")
    ops._site_queue_to_its_worker("h3", "west")
    told.assert_called_once_with("site.west", destination=["h3@node"], reply=False)
