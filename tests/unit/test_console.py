import threading
import time

from vmmgr import console


def write(path, text):
    with path.open("ab") as f:
        f.write(text.encode())


def test_segments_are_numbered_in_order_and_joined(tmp_path):
    first = console.next_segment(tmp_path, "vm", "host1")
    write(first, "tick 0\ntick 1\n")
    paths = [first]
    for i in range(2, 13):  # past 9 and 10: order must be numeric
        seg = console.next_segment(tmp_path, "vm", f"host{i}")
        write(seg, f"tick {i}\n")
        paths.append(seg)
    assert console.segments(tmp_path, "vm") == paths
    assert console.read(tmp_path, "vm").decode().splitlines()[:3] == ["tick 0", "tick 1", "tick 2"]
    assert console.hosts_seen(tmp_path, "vm")[:2] == ["host1", "host2"]


def test_an_empty_segment_from_an_aborted_move_is_skipped_and_never_reused(tmp_path):
    write(console.next_segment(tmp_path, "vm", "host1"), "a\n")
    aborted = console.next_segment(tmp_path, "vm", "host2")
    aborted.touch()
    after = console.next_segment(tmp_path, "vm", "host3")
    assert after.name.startswith("000003-")
    write(after, "b\n")
    assert console.hosts_seen(tmp_path, "vm") == ["host1", "host3"]
    assert console.read(tmp_path, "vm") == b"a\nb\n"


def test_unknown_vm_has_no_output(tmp_path):
    assert console.read(tmp_path, "nobody") == b""
    assert console.segments(tmp_path, "nobody") == []


def test_follow_switches_hosts_without_losing_the_sources_last_bytes(tmp_path):
    seg1 = console.next_segment(tmp_path, "vm", "host1")
    write(seg1, "tick 0\n")
    got, done = [], threading.Event()

    def reader():
        for chunk in console.follow(tmp_path, "vm", poll=0.01, stop=done.is_set):
            got.append(chunk)

    t = threading.Thread(target=reader)
    t.start()
    time.sleep(0.05)
    write(seg1, "tick 1\n")  # the source's last tick ...
    seg2 = console.next_segment(tmp_path, "vm", "host2")
    write(seg2, "tick 2\n")  # ... then the destination's first
    time.sleep(0.05)
    write(seg2, "tick 3\n")
    time.sleep(0.05)
    done.set()
    t.join(2)
    assert b"".join(got) == b"tick 0\ntick 1\ntick 2\ntick 3\n"


def test_remove_forgets_the_vm(tmp_path):
    write(console.next_segment(tmp_path, "vm", "host1"), "x")
    console.remove(tmp_path, "vm")
    assert console.segments(tmp_path, "vm") == []
    assert console.next_segment(tmp_path, "vm", "h").name == "000001-h.log"
