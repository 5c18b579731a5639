#!/bin/sh
# Sets up the edge to hold a VM's packets through its switch-over (vmmgr/edge.py: hold, release).
# Run once at boot on the edge (the edge role's vmmgr-edge-hold.service; the lab runs it in its
# edge's namespace). Idempotent.
#
#   vmhold      a held VM's /32 is routed here, through a next hop that never answers ARP: the
#               kernel queues its packets in that neighbour entry
#   vmhold-out  the other end: a release gives the next hop this MAC, and the queue comes back
#               in here to be routed down the tunnel of the VM's new host
#
# Bounds, per held VM: HOLD_BYTES of queued packets (past it the oldest are dropped: what TCP
# would have resent first anyway); HOLD_SECONDS at most (then the kernel gives the next hop up
# and drops the queue: a switch-over this long has failed, and vmmgr routes and releases anyway).
set -eu
HOLD_BYTES=${HOLD_BYTES:-4194304}
HOLD_SECONDS=${HOLD_SECONDS:-30}

if ! ip link show vmhold >/dev/null 2>&1; then
    ip link add vmhold type veth peer name vmhold-out
fi
ip link set vmhold-out address 02:76:6d:68:6f:6c
ip link set vmhold up
ip link set vmhold-out up
# What comes back in through vmhold-out has an outside source: no reverse-path check there
# (the kernel takes the larger of `all` and the interface's value, so `all` must allow it too).
sysctl -qw net.ipv4.conf.vmhold-out.rp_filter=0
if [ "$(sysctl -n net.ipv4.conf.all.rp_filter)" = 1 ]; then
    sysctl -qw net.ipv4.conf.all.rp_filter=2
fi
sysctl -qw net.ipv4.conf.vmhold.send_redirects=0 net.ipv4.conf.vmhold-out.send_redirects=0
# An unanswered next hop is probed once a second HOLD_SECONDS times before it is given up.
sysctl -qw net.ipv4.neigh.vmhold.unres_qlen_bytes="$HOLD_BYTES" \
    net.ipv4.neigh.vmhold.retrans_time_ms=1000 \
    net.ipv4.neigh.vmhold.mcast_solicit="$HOLD_SECONDS" \
    net.ipv4.neigh.vmhold.app_solicit=0
