"""Local disks: which of a definition's disks a migration copies, the volumes asked of libvirt,
the disk phase's policy and progress, and the requests refused."""

import xml.etree.ElementTree as ET

import pytest

from vmmgr import local_disks, policy as pol
from vmmgr.display import progress_line
from vmmgr.errors import InvalidRequest
from vmmgr.migration import JobProgress
from vmmgr.spec import make_spec

DOMAIN = f"""<domain><devices>
  <disk type='file' device='disk'><source file='{local_disks.disk_path("vm1")}'/>
    <target dev='vda' bus='virtio'/></disk>
  <disk type='file' device='cdrom'><source file='/var/lib/vmmgr/storage/disks/vm1-seed.iso'/>
    <target dev='vdb'/><readonly/></disk>
  <disk type='file' device='disk'><source file='/var/lib/vmmgr/storage/disks/vm1-swap.img'/>
    <target dev='vdc'/></disk>
  <disk type='file' device='disk'><source file='{local_disks.POOL_DIR}/other.qcow2'/>
    <target dev='vdd'/><readonly/></disk>
  <disk type='file' device='disk'><source file='{local_disks.POOL_DIR}/vm1-seed.iso'/>
    <target dev='vde'/><readonly/></disk>
</devices></domain>"""


def test_only_writable_disks_on_the_hosts_own_storage_are_copied():
    assert local_disks.local_disks(DOMAIN) == ["vda"]
    assert local_disks.local_disks("<domain><devices/></domain>") == []
    # a path that only starts like the pool's is not in it
    assert not local_disks.is_local(local_disks.POOL_DIR + "-other/vm1.qcow2")


def test_volume_xml_escapes_what_it_is_given():
    xml = local_disks.overlay_xml("vm1", 3 * 2**30, "/images/a&b<c>.qcow2")
    root = ET.fromstring(xml)
    assert root.findtext("name") == "vm1.qcow2"
    assert root.findtext("capacity") == str(3 * 2**30)
    assert root.findtext("./backingStore/path") == "/images/a&b<c>.qcow2"
    assert root.find("./target/permissions/mode").text == "0600"
    copy = ET.fromstring(local_disks.copy_xml("vm1", 12345))
    assert copy.findtext("capacity") == "12345" and copy.find("./target/format").get("type") == "raw"


def test_the_disk_phase_holds_the_memory_clocks_and_has_a_timeout_of_its_own():
    policy = pol.get_policy("balanced")
    w, _ = pol.start(policy, 0.0)
    disk = {"disk_total": 100, "disk_processed": 10, "data_total": 100}
    assert pol.in_disk_phase(disk)
    assert not pol.in_disk_phase(disk | {"memory_iteration": 1, "memory_processed": 5})
    assert not pol.in_disk_phase({"data_total": 100})  # no local disk
    # 200 s of disk copy: the memory's "no progress" timeout (60 s) does not fire
    for now in range(0, 200, 10):
        w, actions = pol.decide_disk(policy, w, float(now))
        assert actions == []
    w, actions = pol.decide(policy, w, 50, 1, 200.0)
    assert actions == []  # the memory's clock began when its copy did
    w2, _ = pol.start(policy, 0.0)
    w2, actions = pol.decide_disk(policy, w2, policy.completion_timeout_s + 1)
    assert [type(a) for a in actions] == [pol.Abort] and "disk copy" in actions[0].reason


def test_the_progress_line_names_the_disk_phase():
    p = JobProgress(elapsed_ms=2500, processed_bytes=40 * 2**20, remaining_bytes=35 * 2**20,
                    total_bytes=75 * 2**20, speed_bps=0, dirty_rate_bps=0, iteration=0,
                    phase="disk", disk_processed_bytes=30 * 2**20, disk_total_bytes=60 * 2**20)
    line = progress_line(p)
    assert "disk 30/60 MiB" in line and "(memory next)" in line and p.fraction == 0.5


def test_a_local_disk_needs_an_image_and_no_devices(tmp_path):
    with pytest.raises(InvalidRequest, match="go with an OS image"):
        make_spec("vm1", memory_mib=128, vcpus=1, kernel=tmp_path / "k", image_root=tmp_path,
                  local_disk=True)


def test_a_migration_copies_the_local_disk_and_names_the_target_for_its_tls(mocker):
    import libvirt

    from vmmgr.migration import _Migration

    dest = mocker.Mock(uri="qemu+tls://10.77.0.13/system?pkipath=/etc/x")
    dest.record.tls, dest.record.lab = True, False
    fleet = mocker.Mock()
    fleet.host.return_value = dest
    guest = mocker.Mock(host_name="h1")
    guest.xml.return_value = DOMAIN
    move = _Migration(fleet, guest, "h3", pol.get_policy("balanced"), None, 0.1,
                      mocker.Mock(lost=False))
    move.disks = local_disks.local_disks(DOMAIN)
    flags, params = move._flags_and_params(mocker.MagicMock())
    assert flags & libvirt.VIR_MIGRATE_NON_SHARED_INC and flags & libvirt.VIR_MIGRATE_TLS
    assert not flags & libvirt.VIR_MIGRATE_NON_SHARED_DISK  # the base is on both sides
    assert params[libvirt.VIR_MIGRATE_PARAM_MIGRATE_DISKS] == ["vda"]
    assert params[libvirt.VIR_MIGRATE_PARAM_TLS_DESTINATION] == "10.77.0.13"
    move.disks = []
    flags, params = move._flags_and_params(mocker.MagicMock())
    assert not flags & libvirt.VIR_MIGRATE_NON_SHARED_INC
    assert libvirt.VIR_MIGRATE_PARAM_MIGRATE_DISKS not in params


def test_the_pool_lists_each_vm_with_a_disk(mocker):
    import libvirt
    conn = mocker.Mock()
    pool = conn.storagePoolLookupByName.return_value
    pool.listVolumes.return_value = ["vm1.qcow2", "web-2.qcow2", ".qcow2", "notes.txt",
                                     "vm1-seed.iso", "vm9-seed.iso", "vm1.save"]
    assert local_disks.held(conn) == {"vm1", "web-2"}  # a seed is not a disk
    pool.isActive.return_value = 0
    assert local_disks.held(conn) == set()
    err = libvirt.libvirtError("no pool")
    mocker.patch.object(err, "get_error_code", return_value=libvirt.VIR_ERR_NO_STORAGE_POOL)
    conn.storagePoolLookupByName.side_effect = err
    assert local_disks.held(conn) == set()  # never used local disks: no pool is made for it
    conn.storagePoolDefineXML.assert_not_called()


def _no_domain(mocker, conn):
    import libvirt
    err = libvirt.libvirtError("no domain")
    mocker.patch.object(err, "get_error_code", return_value=libvirt.VIR_ERR_NO_DOMAIN)
    conn.lookupByName.side_effect = err


def test_a_vms_seed_is_removed_before_its_overlay_and_never_while_it_is_defined(mocker):
    conn, deleted = mocker.Mock(), []
    vols = {n: mocker.Mock(**{"delete.side_effect": lambda _f, n=n: deleted.append(n)})
            for n in ("vm1.qcow2", "vm1-seed.iso")}
    mocker.patch.object(local_disks, "find", side_effect=lambda c, vm, name="":
                        vols.get(name or local_disks.volume_name(vm)))
    _no_domain(mocker, conn)
    assert local_disks.remove(conn, "vm1") is True
    assert deleted == ["vm1-seed.iso", "vm1.qcow2"]  # a seed never outlives its overlay
    conn.lookupByName.side_effect = None  # defined here: both stay
    with pytest.raises(local_disks.VmmgrError, match="defined on this host"):
        local_disks.remove(conn, "vm1")
    assert deleted == ["vm1-seed.iso", "vm1.qcow2"]


def test_a_copy_that_cannot_send_the_seed_leaves_nothing_on_the_target(mocker):
    source, target = mocker.Mock(), mocker.Mock()
    sent = []

    def fake_copy(src, dst, vm, name, progress=None):
        sent.append(name)
        if name.endswith("-seed.iso"):
            raise local_disks.VmmgrError("link cut")
        return "sum"

    mocker.patch.object(local_disks, "_copy", side_effect=fake_copy)
    mocker.patch.object(local_disks, "find", return_value=mocker.Mock())
    remove = mocker.patch.object(local_disks, "remove")
    with pytest.raises(local_disks.VmmgrError, match="link cut"):
        local_disks.copy(source, target, "vm1", seed=True)
    assert sent == ["", "vm1-seed.iso"]  # the disk ("": its overlay) first, then its seed
    remove.assert_called_once_with(target, "vm1")
    # the cleanup's own failure (the target stopped answering) hides not the first error
    remove.side_effect = local_disks.VmmgrError("host3 does not answer")
    with pytest.raises(local_disks.VmmgrError, match="link cut"):
        local_disks.copy(source, target, "vm1", seed=True)
    # a VM made before seeds were kept in the pool: its disk alone is sent
    sent.clear()
    assert local_disks.copy(source, target, "vm1", seed=False) == "sum" and sent == [""]


def test_a_definition_says_whether_its_seed_is_in_the_pool():
    assert local_disks.has_pool_seed(DOMAIN.replace("<domain>", "<domain><name>vm1</name>"))
    # a seed of another name in the pool is not its own; one on storage is not in the pool
    assert not local_disks.has_pool_seed(DOMAIN.replace("<domain>", "<domain><name>vm2</name>"))
    old = DOMAIN.replace(f"{local_disks.POOL_DIR}/vm1-seed.iso", "/srv/storage/disks/x.iso")
    assert not local_disks.has_pool_seed(old.replace("<domain>", "<domain><name>vm1</name>"))


def test_a_seed_is_received_into_its_own_volume_and_a_disk_replaces_both(mocker):
    """`_receive`: a seed arriving replaces only a seed; a disk arriving replaces the VM's
    volumes there (a run cut short left them); what fails to arrive is removed alone."""
    conn = mocker.Mock()
    delete = mocker.patch.object(local_disks, "_delete")
    remove = mocker.patch.object(local_disks, "remove")
    mocker.patch.object(local_disks, "ensure_pool")
    upload = mocker.patch.object(local_disks, "upload", return_value="sum")
    assert local_disks._receive(conn, "vm1", 3, iter([b"abc"]), None, "vm1-seed.iso") == "sum"
    delete.assert_called_once_with(conn, "vm1", "vm1-seed.iso")
    remove.assert_not_called()
    assert "vm1's seed" in upload.call_args.args[-1]
    made = ET.fromstring(local_disks.ensure_pool.return_value.createXML.call_args.args[0])
    assert made.findtext("name") == "vm1-seed.iso"
    delete.reset_mock()
    assert local_disks._receive(conn, "vm1", 3, iter([b"abc"]), None) == "sum"
    remove.assert_called_once_with(conn, "vm1")
    delete.assert_not_called()
    upload.side_effect = local_disks.VmmgrError("cut")
    with pytest.raises(local_disks.VmmgrError):
        local_disks._receive(conn, "vm1", 3, iter([b"abc"]), None, "vm1-seed.iso")
    assert delete.call_args_list[-1].args == (conn, "vm1", "vm1-seed.iso")  # not the disk
