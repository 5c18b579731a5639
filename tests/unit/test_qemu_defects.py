from vmmgr.qemu_defects import tcg_migration_warning, version_tuple


def test_libvirt_versions_read_as_tuples():
    assert version_tuple(7_002_022) == (7, 2, 22)
    assert version_tuple(10_000_002) == (10, 0, 2)


def test_tcg_before_9_0_is_warned_about():
    warning = tcg_migration_warning("tcg", 7_002_022)
    assert warning.startswith("QEMU 7.2.22 loses dirty pages")
    assert "9.0 or later" in warning
    assert tcg_migration_warning("tcg", 8_002_009) is not None


def test_fixed_qemu_and_kvm_are_not():
    assert tcg_migration_warning("tcg", 9_000_000) is None
    assert tcg_migration_warning("tcg", 10_000_002) is None
    assert tcg_migration_warning("kvm", 7_002_022) is None  # KVM tracks dirty pages in the kernel
