"""A fleet of saves only, for the unit tests of what acts on save folders: its paths and store
(given), and the real rules for whose saves this node sees."""

from types import SimpleNamespace

from vmmgr.fleet import Fleet


class SavesFleet(SimpleNamespace):
    own_site, save_site, sees_save = Fleet.own_site, Fleet.save_site, Fleet.sees_save
    require_save_here, require_own_site = Fleet.require_save_here, Fleet.require_own_site
    require_site_holds, require_disk_reaches = Fleet.require_site_holds, Fleet.require_disk_reaches

    def sites(self) -> dict[str, str]:
        return getattr(self, "site_of", {})  # none named unless a test names them
