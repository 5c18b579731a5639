"""VM spec -> libvirt domain XML, through the Jinja2 templates in xml-templates/."""

import sys
import xml.etree.ElementTree as ET
from functools import lru_cache
from pathlib import Path

from .addresses import mac_for
from .spec import VMSpec

XMLNS = "https://vmmgr.dev/xmlns/vm/1"
QEMU_NS = "http://libvirt.org/schemas/domain/qemu/1.0"  # libvirt's namespace for QEMU's own options


def _template_dir() -> Path:
    # A source checkout (editable install) first, then the copy setup.cfg installs as data files.
    for candidate in (
        Path(__file__).resolve().parent.parent / "xml-templates",
        Path(sys.prefix) / "share" / "vmmgr" / "xml-templates",
    ):
        if (candidate / "domain.xml.j2").is_file():
            return candidate
    raise FileNotFoundError("xml-templates/domain.xml.j2 not found")


@lru_cache(maxsize=1)
def _env():
    import jinja2  # only where XML is rendered: the CLI's start-up is a hop's wall time

    return jinja2.Environment(
        loader=jinja2.FileSystemLoader(_template_dir()),
        autoescape=True,
        undefined=jinja2.StrictUndefined,
        keep_trailing_newline=True,
    )


def domain_xml(spec: VMSpec, *, accel: str, console_path: Path, bridge: str = "br-guest") -> str:
    if accel not in ("kvm", "tcg"):
        raise ValueError(f"accel must be 'kvm' or 'tcg', not {accel!r}")
    return _env().get_template("domain.xml.j2").render(
        spec=spec, accel=accel, console_path=str(console_path), xmlns=XMLNS,
        mac=mac_for(spec.address) if spec.address else "", bridge=bridge,
    )


def address_of(xml: str) -> str | None:
    """The stable address recorded in a domain's metadata, if it has one."""
    el = ET.fromstring(xml).find(f"./metadata/{{{XMLNS}}}vm/{{{XMLNS}}}address")
    return el.text if el is not None and el.text else None


def workload_of(xml: str) -> str:
    """The built-in workload recorded in a domain's metadata ("" for a user kernel)."""
    el = ET.fromstring(xml).find(f"./metadata/{{{XMLNS}}}vm/{{{XMLNS}}}workload")
    return (el.text or "") if el is not None else ""


def group_of(xml: str) -> str:
    """The job (group) a domain's metadata puts it in ("" for none)."""
    el = ET.fromstring(xml).find(f"./metadata/{{{XMLNS}}}vm/{{{XMLNS}}}group")
    return (el.text or "") if el is not None else ""


def console_path_of(xml: str) -> Path | None:
    """Where the domain's serial console writes (None: nowhere vmmgr named)."""
    source = ET.fromstring(xml).find("./devices/serial/source")
    return Path(source.get("path")) if source is not None and source.get("path") else None


def set_console_path(xml: str, path: Path) -> str:
    """The same domain XML with its serial console (and the console that mirrors it) at `path`."""
    ET.register_namespace("vmmgr", XMLNS)
    ET.register_namespace("qemu", QEMU_NS)
    root = ET.fromstring(xml)
    for source in root.findall("./devices/serial/source") + root.findall("./devices/console/source"):
        source.set("path", str(path))
    return ET.tostring(root, encoding="unicode")
