"""How a VM would move if its host were reclaimed now, and why: a pure decision for display and
for the operator's confidence. Reclaim itself takes the same decisions step by step.
"""


def how_it_moves(choices: list[dict], live: bool = True, not_live_because: str = "") -> dict:
    """From `placement.target_choices` (with the VM's device needs) and whether a device blocks
    live migration: the path a reclaim would take, with the reason."""
    fitting = [c["host"] for c in choices if c["ok"]]
    others = [c for c in choices if c["reason"] != "the VM runs here"]
    why_not = "; ".join(f"{c['host']}: {c['reason']}" for c in others) or "no other host"
    if not live:
        where = (f"then boots from its image on {', '.join(fitting)}" if fitting else
                 f"and stays parked until a host can take it ({why_not})")
        return {"mode": "guest hibernation",
                "reason": f"it {not_live_because}: never live-migrated; its guest hibernates to "
                          f"shared storage {where}"}
    if fitting:
        return {"mode": "live migration", "reason": f"fits on {', '.join(fitting)}"}
    return {"mode": "suspend to disk", "reason": f"no other host has room ({why_not})"}
