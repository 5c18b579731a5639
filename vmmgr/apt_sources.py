"""Where this machine's apt takes Debian from: what is built from Debian packages (the OS image,
the deploy test's trees) comes from the same place, so a machine behind a local mirror or proxy
keeps working and no mirror is named in the project."""

from pathlib import Path

from .errors import VmmgrError

APT = Path("/etc/apt")


def debian_mirror(suite: str = "bookworm", apt: Path = APT) -> str:
    """The URI of the first apt source for `suite` (one-line or deb822 sources)."""
    for f in [apt / "sources.list", *sorted((apt / "sources.list.d").glob("*.list"))]:
        for line in f.read_text().splitlines() if f.is_file() else []:
            words = line.split("#", 1)[0].split()
            if words[:1] == ["deb"]:
                rest = words[1:]
                if rest and rest[0].startswith("["):  # options: [a=b c=d]
                    while rest and not rest[0].endswith("]"):
                        rest = rest[1:]
                    rest = rest[1:]
                if len(rest) >= 2 and rest[1] == suite:
                    return rest[0]
    for f in sorted((apt / "sources.list.d").glob("*.sources")):
        for stanza in f.read_text().split("\n\n"):
            fields = dict(line.split(":", 1) for line in stanza.splitlines()
                          if ":" in line and not line.startswith("#"))
            fields = {k.strip().lower(): v.split() for k, v in fields.items()}
            if suite in fields.get("suites", []) and fields.get("uris"):
                return fields["uris"][0]
    raise VmmgrError(f"no apt source for Debian {suite} on this machine to build from")
