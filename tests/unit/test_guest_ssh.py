"""`vm ssh`'s pure parts: the host keys pinned from the console, the ssh command line."""

from pathlib import Path

from vmmgr import guest_ssh

BLOCK = """\
-----BEGIN SSH HOST KEY KEYS-----\r
ecdsa-sha2-nistp256 AAAAE2VjZHNh= root@{n}\r
ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAI{n} root@{n}\r
-----END SSH HOST KEY KEYS-----\r
"""


def test_the_last_block_of_host_keys_on_the_console_wins():
    console = "boot noise\n" + BLOCK.format(n="old") + "reboot\n" + BLOCK.format(n="new") + "x"
    assert guest_ssh.host_keys(console) == [
        "ecdsa-sha2-nistp256 AAAAE2VjZHNh=", "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAInew"]
    assert guest_ssh.known_hosts("10.78.0.9", ["ssh-ed25519 AAAA"]) == "10.78.0.9 ssh-ed25519 AAAA\n"


def test_no_block_or_garbage_in_it_pins_nothing():
    assert guest_ssh.host_keys("no keys here") == []
    fake = BLOCK.format(n="x").replace("ssh-ed25519 AAAA", "evil-type AAAA").replace(
        "ecdsa-sha2-nistp256 AAAAE2VjZHNh=", "ssh-rsa $(reboot)")
    assert guest_ssh.host_keys(fake) == []


def test_the_command_line_pins_when_given_a_known_hosts_file():
    pinned = guest_ssh.argv(Path("/k"), "10.78.0.9", "uptime", ["ip", "netns", "exec", "c"],
                            known_hosts_file=Path("/kh"))
    assert pinned[:4] == ["ip", "netns", "exec", "c"]
    assert "StrictHostKeyChecking=yes" in pinned and "UserKnownHostsFile=/kh" in pinned
    assert pinned[-2:] == ["vmmgr@10.78.0.9", "uptime"] and "-t" not in pinned
    login = guest_ssh.argv(None, "10.78.0.9", tty=True)
    assert "-i" not in login and login[-2:] == ["-t", "vmmgr@10.78.0.9"]
    assert "StrictHostKeyChecking=no" in login  # only for VMs the caller itself just made
