"""The lab's user-space delay line (used where the kernel has no sch_netem): its pure parts. The
lab test (test_sites.py) measures the round trip it makes between real hosts."""

import random

from vmmgr.lab_delay import VNET_HDR, DelayLine, destination


def ipv4(dst: str) -> bytes:
    header = bytes([0x45, 0, 0, 20, 0, 0, 0, 0, 64, 6, 0, 0, 10, 77, 0, 11])
    return bytes(VNET_HDR) + header + bytes(int(b) for b in dst.split("."))


def test_a_packet_goes_to_its_ipv4_destination_and_nothing_else_is_routed():
    assert destination(ipv4("10.77.0.13")) == "10.77.0.13"
    ipv6 = bytes(VNET_HDR) + bytes([0x60]) + bytes(39)
    assert destination(ipv6) is None
    assert destination(bytes(VNET_HDR) + b"\x45") is None  # too short to carry one


def test_packets_leave_after_the_delay_in_the_order_they_came():
    line = DelayLine(0.020)
    assert line.wait_s(0.0) is None
    line.send(1.000, "a", b"1")
    line.send(1.005, "b", b"2")
    assert line.due(1.019) == [] and abs(line.wait_s(1.019) - 0.001) < 1e-9
    assert line.due(1.020) == [("a", b"1")]
    line.send(1.021, "a", b"3")
    assert line.due(1.100) == [("b", b"2"), ("a", b"3")]
    assert line.wait_s(1.100) is None


def test_the_loss_is_drawn_per_packet_and_the_queue_is_bounded():
    line = DelayLine(0.0, loss=0.25, rng=random.Random(7))
    sent = sum(line.send(0.0, "a", b"x") for _ in range(4000))
    assert 2850 < sent < 3150 and line.dropped == 4000 - sent
    full = DelayLine(1.0, limit_bytes=4)
    sent = [full.send(0.0, "a", bytes([i]) * 2) for i in range(3)] + [full.send(0.0, "a", b"z")]
    assert sent == [True, True, False, False] and full.held == 4 and full.dropped == 2
    assert [p for _, p in full.due(2.0)] == [b"\x00\x00", b"\x01\x01"] and full.held == 0
    assert full.send(2.0, "a", b"yy")  # room again once they left
