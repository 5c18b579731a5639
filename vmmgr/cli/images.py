"""`vmmgr image ...`: the OS images disk-backed VMs start from, on the storage every host sees."""

import json
from contextlib import contextmanager
from pathlib import Path

import click

from .. import display, image_build, os_images
from ..fleet import Fleet
from ..paths import Paths
from ..state import FleetState
from .base import audit_cli, cli, emit_json, log_line

GiB = 2**30


@cli.group()
def image() -> None:
    """OS images: `image build debian-12`, `image import NAME FILE`, `image list`."""


@image.command("build")
@click.argument("name", type=click.Choice(sorted(image_build.RECIPES)))
@click.pass_obj
def image_build_cmd(paths: Paths, name: str) -> None:
    """Build an image from Debian packages (cached: rebuilt only when its recipe changes)."""
    with _image_held(paths, name, f"build of image {name}"):
        built = image_build.build(paths.images, name, used_by=vms_on(paths, name), log=log_line)
    audit_cli(paths, "image build", name, "ok", {"recipe": built.recipe})
    click.echo(f"image {built.name}: {_row(built)[2]}, sha256 {built.sha256}")


@image.command("import")
@click.argument("name")
@click.argument("file", type=click.Path(path_type=Path))
@click.pass_obj
def image_import(paths: Paths, name: str, file: Path) -> None:
    """Import a qcow2 or raw cloud image that boots with its own bootloader and cloud-init."""
    imported = os_images.import_image(paths.images, name, file, log=log_line)
    audit_cli(paths, "image import", name, "ok", {"file": str(file)})
    click.echo(f"image {imported.name}: {_row(imported)[2]}, sha256 {imported.sha256}")


@image.command("list")
@click.option("--json", "as_json", is_flag=True)
@click.pass_obj
def image_list(paths: Paths, as_json: bool) -> None:
    images = os_images.list_images(paths.images)
    if as_json:
        return emit_json([i.as_dict() for i in images])
    click.echo(display.table(["image", "format", "virtual size", "on storage", "sha256", "source"],
                             [_row(i) for i in images]))


@image.command("remove")
@click.argument("name")
@click.pass_obj
def image_remove(paths: Paths, name: str) -> None:
    with _image_held(paths, name, f"removal of image {name}"):
        os_images.remove_image(paths.images, name, used_by=vms_on(paths, name))
    audit_cli(paths, "image remove", name, "ok")
    click.echo(f"image {name} removed")


@image.command("verify")
@click.argument("name")
@click.pass_obj
def image_verify(paths: Paths, name: str) -> None:
    """Check that storage still holds the image exactly as it was stored (its SHA-256)."""
    checked = os_images.verify(paths.images, name)
    click.echo(f"image {name}: intact (sha256 {checked.sha256})")


def vms_on(paths: Paths, image_name: str) -> list[str]:
    """The VMs whose disks are overlays on the image: by their records, and by the disks on
    storage (a VM being created has its disk before its record)."""
    on_disk = os_images.overlays_on(paths.images, paths.storage / "disks", image_name)
    url = paths.redis_url()
    records = FleetState(url).vms() if url is not None else {}
    return sorted(set(on_disk) | {vm for vm, rec in records.items()
                                  if json.loads(rec.get("spec") or "{}").get("image")
                                  == image_name})


@contextmanager
def _image_held(paths: Paths, name: str, what: str):
    """The image's lock, where there is a fleet store: no create lays a disk on the image while
    this checks for such disks and takes the image away."""
    if paths.redis_url() is None:
        yield
        return
    with Fleet(paths) as fleet, fleet.lock_image(name, what):
        yield


def _row(i: os_images.OsImage) -> list[str]:
    return [i.name, i.format, f"{i.virtual_size / GiB:.1f} GiB", f"{i.size / GiB:.2f} GiB",
            i.sha256[:16], i.source]
