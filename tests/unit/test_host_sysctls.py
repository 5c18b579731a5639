"""The kernel settings the lab gives each host are the ones the kvm_host role writes."""

from pathlib import Path

import yaml

from vmmgr import lab

TASKS = Path(__file__).resolve().parents[2] / "ansible" / "roles" / "kvm_host" / "tasks" / "main.yml"


def role_sysctls() -> dict[str, str]:
    tasks = yaml.safe_load(TASKS.read_text())
    return {item["name"]: item["value"] for task in tasks if "ansible.posix.sysctl" in task
            for item in task.get("loop", [])}


def test_the_lab_limits_unsent_tcp_bytes_as_the_role_does():
    settings = role_sysctls()
    assert settings["net.ipv4.tcp_notsent_lowat"] == str(lab.TCP_NOTSENT_LOWAT)
    # Far below the 4 MiB a stream's send buffer grows to, far above what one write holds.
    assert 64 * 1024 <= lab.TCP_NOTSENT_LOWAT <= 512 * 1024


def test_the_lab_sizes_tcp_buffers_for_the_wan_as_the_role_does():
    settings = role_sysctls()
    for key, value in lab.TCP_BUFFERS.items():
        assert settings[key] == value
        # min, default, max: the max holds 80 ms of 1 Gbit/s (10 MB) with room for overhead
        low, default, high = (int(v) for v in value.split())
        assert low <= default <= high and high >= 2 * 10 * 10**6
    assert lab.HOST_SYSCTLS["net.ipv4.tcp_notsent_lowat"] == str(lab.TCP_NOTSENT_LOWAT)


def test_every_setting_the_lab_gives_its_hosts_is_one_the_role_writes():
    settings = role_sysctls()
    assert {key: settings.get(key) for key in lab.HOST_SYSCTLS} == lab.HOST_SYSCTLS
