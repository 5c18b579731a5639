#!/bin/sh
# /init of vmmgr's built-in guest (busybox-static initramfs).
# Parameters come from the kernel command line as vmmgr.KEY=VALUE words.
# Everything a workload prints goes to the serial console: that output is what the tests compare
# across moves, so nothing else (no kernel messages: `quiet loglevel=0`) may write there
# (but the one line a VM with a swap disk writes when it boots afresh, below).
/bin/busybox --install -s /bin
mount -t proc proc /proc
mount -t sysfs sysfs /sys
mount -t devtmpfs devtmpfs /dev

param() {  # param KEY DEFAULT
  for word in $(cat /proc/cmdline); do
    case "$word" in "vmmgr.$1="*) echo "${word#*=}"; return ;; esac
  done
  echo "$2"
}

# virtio drivers are modules in Debian's cloud kernel; load them in dependency order.
for m in virtio_ring virtio virtio_pci_modern_dev virtio_pci_legacy_dev virtio_pci \
         failover net_failover virtio_net virtio_blk virtio_console; do
  [ -f "/lib/modules/$m.ko" ] && insmod "/lib/modules/$m.ko" 2>/dev/null
done

# A VM that may have to hibernate (one with a passed-through device) has a swap disk, vda.
# Resume first: when vda holds a hibernation image, writing its device number to
# /sys/power/resume makes the kernel restore that image here: this script then never goes
# further, the hibernated system (this same script, further along) carries on instead.
if [ -b /dev/vda ]; then
  cat /sys/block/vda/dev > /sys/power/resume 2>/dev/null
  # Still here: no image was restored (a first boot, or an image the kernel could not use).
  # vmmgr's resume reads this line (the only one /init writes itself) to tell a lost memory
  # from a restored one.
  echo "vmmgr: fresh boot"
  # No image (a first boot): make the swap area the next hibernation writes to.
  mkswap /dev/vda >/dev/null 2>&1 && swapon /dev/vda 2>/dev/null
  # The kernel writes its image, then powers off (S5): the VM can be started anywhere after.
  echo shutdown > /sys/power/disk
  # The smallest image: the kernel frees what it can first (a small guest has little to spare).
  echo 0 > /sys/power/image_size
fi

# The guest agent, on the virtio-serial port libvirt names org.qemu.guest_agent.0 (unless
# vmmgr.agent=off: the lab's way to test a guest whose agent does not answer).
if [ "$(param agent on)" = on ]; then
  for p in /sys/class/virtio-ports/*; do
    [ "$(cat "$p/name" 2>/dev/null)" = org.qemu.guest_agent.0 ] && qga "/dev/${p##*/}" /dev/vda &
  done
fi

# A stable address (vmmgr.ip) is a /32 behind the gateway every host serves (vmmgr.gw) with the
# same MAC, so nothing in the guest changes when it moves.
ip=$(param ip "")
if [ -n "$ip" ]; then
  gw=$(param gw 10.78.0.1)
  ip link set lo up
  ip link set eth0 up
  ip addr add "$ip/32" dev eth0
  ip route add "$gw" dev eth0
  ip route add default via "$gw" dev eth0
fi

serve() {  # serves the `stream` generator's MIB MiB at RATE MiB/s to every client of PORT
  printf '#!/bin/sh\nexec stream %s %s\n' "$(param mib 200)" "$(param rate 0)" > /tmp/serve
  chmod +x /tmp/serve
  echo "serving on port $(param port 8080)"
  nc -ll -p "$(param port 8080)" -e /tmp/serve
}

fetch() {  # downloads from HOST:PORT once and prints the SHA-256 of what arrived
  echo "fetching from $(param from '')"
  sum=$(nc "$(param from '' | cut -d: -f1)" "$(param from '' | cut -d: -f2)" | sha256sum)
  echo "fetched ${sum%% *}"
}

reach() {  # "reach IP:PORT open" if a TCP connection to it is made within 3 s, else "closed"
  for target in $(param to '' | tr '+' ' '); do
    if nc -w 3 "${target%:*}" "${target##*:}" -e true 2>/dev/null; then
      echo "reach $target open"
    else
      echo "reach $target closed"
    fi
  done
  spoof=$(param spoof '')
  if [ -n "$spoof" ]; then  # another address than its own: the host must not let it out
    ip addr add "$spoof/32" dev eth0
    for target in $(param to '' | tr '+' ' '); do
      ping -c 3 -W 1 -I "$spoof" "${target%:*}" >/dev/null 2>&1
    done
    ip addr del "$spoof/32" dev eth0
    echo "spoofed pings sent"
  fi
  echo "reach done"
}

counter() {  # prints "tick N" every INTERVAL seconds; stops after COUNT ticks when COUNT > 0
  interval=$(param interval 0.2)
  count=$(param count 0)
  i=0
  while [ "$count" -eq 0 ] || [ "$i" -lt "$count" ]; do
    echo "tick $i"
    i=$((i + 1))
    sleep "$interval"
  done
  echo "counter done"
}

case "$(param workload idle)" in
  probe) echo "vmmgr-probe-ok"; poweroff -f ;;
  counter) counter ;;
  dirtier) dirtier "$(param rate 8)" "$(param mib 32)" ;;
  server) serve ;;
  fetch) fetch ;;
  reach) reach ;;
  idle) ;;
  *) echo "unknown workload $(param workload idle)" ;;
esac
# A workload that ends leaves the VM idle (and migratable), never halted.
while true; do sleep 3600; done
