#!/bin/sh
# libvirt's qemu hook (/etc/libvirt/hooks/qemu) on a vmmgr host: keep a /32 route to every local
# guest's stable address on the guest bridge. libvirtd calls it as `qemu DOMAIN OPERATION SUB ...`
# with the domain XML on stdin: `prepare` comes before the VM starts here (boot, incoming
# migration, restore), `release` after it has left (shut down, migrated away, saved).
# It must never fail: a non-zero exit at `prepare` would stop the VM from starting.
PATH=/usr/sbin:/usr/bin:/sbin:/bin
BRIDGE=${VMMGR_GUEST_BRIDGE:-br-guest}
case "$2" in
  prepare|release) ;;
  *) exit 0 ;;
esac
ip=$(sed -n 's|.*<vmmgr:address>\([0-9.]*\)</vmmgr:address>.*|\1|p' | head -n 1)
[ -n "$ip" ] || exit 0
case "$2" in
  prepare) ip route replace "$ip/32" dev "$BRIDGE" ;;
  release) ip route del "$ip/32" dev "$BRIDGE" 2>/dev/null ;;
esac
exit 0
