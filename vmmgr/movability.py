"""How a VM would move if its host were reclaimed now, and why: a pure decision for display and
for the operator's confidence. Reclaim itself takes the same decisions step by step.
"""

from typing import NamedTuple


def how_it_moves(choices: list[dict], live: bool = True, not_live_because: str = "") -> dict:
    """From `placement.target_choices` (with the VM's device needs) and whether a device blocks
    live migration: the path a reclaim would take, with the reason."""
    fitting = [c["host"] for c in choices if c["ok"]]
    refused = [c for c in choices if not c["ok"] and c["reason"] != "the VM runs here"]
    return _summary((fitting, len(fitting)), (refused, len(refused)), live, not_live_because)


NAMED = 5  # hosts named in a summary; the rest are counted


class MovesIndex:
    """`how_it_moves` for many VMs at once, over one listing of hosts: the choices depend only on
    a VM's size and device needs, so they are worked out once per size (a fleet of 20,000 VMs
    has a handful of sizes), and each VM then only leaves its own host out. Past NAMED hosts a
    summary names the first ones and counts the rest."""

    def __init__(self, hosts: dict):
        self.hosts = hosts  # name -> (state, capacity or None), as target_choices takes
        self._by_size: dict[tuple, _Choices] = {}
        self._answers: dict[tuple, dict] = {}

    def moves(self, own_host: str, memory_mib: int, vcpus: int, device_model: str = "",
              device_count: int = 0, live: bool = True, not_live_because: str = "") -> dict:
        key = (memory_mib, vcpus, device_model, device_count)
        c = self._by_size.get(key) or self._choices(key)
        # The answer depends on the VM's own host only if that host is named in it or counted.
        answer = (key, own_host if own_host in c.named else None, own_host in c.fit_names,
                  own_host in c.refused_names, live, not_live_because)
        found = self._answers.get(answer)
        if found is None:
            found = self._answers[answer] = _summary(
                (_first_except(c.fit, own_host, lambda h: h),
                 len(c.fit) - (own_host in c.fit_names)),
                (_first_except(c.refused, own_host, lambda r: r["host"]),
                 len(c.refused) - (own_host in c.refused_names)),
                live, not_live_because)
        return found

    def _choices(self, key: tuple) -> "_Choices":
        if key not in self._by_size:
            from .placement import target_choices

            choices = target_choices(None, *key[:2], self.hosts, *key[2:])
            fit = [c["host"] for c in choices if c["ok"]]
            refused = [c for c in choices if not c["ok"]]
            self._by_size[key] = _Choices(
                fit, set(fit), refused, {c["host"] for c in refused},
                set(fit[:NAMED + 1]) | {c["host"] for c in refused[:NAMED + 1]})
        return self._by_size[key]


class _Choices(NamedTuple):
    """Every host as a target for one VM size: those that fit, in order, and those that don't."""
    fit: list[str]
    fit_names: set[str]
    refused: list[dict]
    refused_names: set[str]
    named: set[str]  # the hosts a summary may name (the first of each list)


def _first_except(items: list, own: str, name) -> list:
    """The first NAMED items not named `own`."""
    first = []
    for item in items:
        if name(item) != own:
            first.append(item)
            if len(first) == NAMED:
                break
    return first


def _summary(fitting: tuple[list, int], refused: tuple[list, int], live: bool,
             not_live_because: str) -> dict:
    names, n_fit = fitting
    where = ", ".join(names) + (f" and {n_fit - len(names)} more" if n_fit > len(names) else "")
    reasons, n_refused = refused
    why_not = "; ".join(f"{c['host']}: {c['reason']}" for c in reasons) + (
        f"; and {n_refused - len(reasons)} more hosts" if n_refused > len(reasons) else "")
    why_not = why_not or "no other host"
    if not live:
        then = (f"then boots from its image on {where}" if n_fit else
                f"and stays parked until a host can take it ({why_not})")
        return {"mode": "guest hibernation",
                "reason": f"it {not_live_because}: never live-migrated; its guest hibernates to "
                          f"shared storage {then}"}
    if n_fit:
        return {"mode": "live migration", "reason": f"fits on {where}"}
    return {"mode": "suspend to disk", "reason": f"no other host has room ({why_not})"}
