"""Known hypervisor defects that change what vmmgr may promise on a host, decided from versions."""

# QEMU before 9.0 loses dirty pages when it live-migrates a TCG guest: the fast dirty-bitmap sync
# clears bits without resetting the softmmu TLB, so later writes through older TLB entries are never
# sent (fixed upstream by 03bfc2188f). KVM tracks dirty pages in the kernel and is not affected.
TCG_DIRTY_TRACKING_FIXED = (9, 0, 0)


def version_tuple(libvirt_version: int) -> tuple[int, int, int]:
    """libvirt reports hypervisor versions as major * 1,000,000 + minor * 1,000 + micro."""
    return libvirt_version // 1_000_000, libvirt_version // 1_000 % 1_000, libvirt_version % 1_000


def tcg_migration_warning(accel: str, qemu_version: int) -> str | None:
    """Why live-migrating this host's guests may corrupt them, or None when it may not."""
    found = version_tuple(qemu_version)
    if accel != "tcg" or found >= TCG_DIRTY_TRACKING_FIXED:
        return None
    return (f"QEMU {'.'.join(map(str, found))} loses dirty pages when it live-migrates a TCG guest "
            "(a migrated guest may crash); QEMU 9.0 or later fixes it (`./run setup` installs it "
            "from bookworm-backports)")
