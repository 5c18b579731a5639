"""Finding the machine's Debian mirror in apt's one-line and deb822 sources."""

import pytest

from vmmgr.apt_sources import debian_mirror
from vmmgr.errors import VmmgrError


def _apt(tmp_path, files: dict):
    (tmp_path / "sources.list.d").mkdir()
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    return tmp_path


def test_one_line_sources_with_options(tmp_path):
    apt = _apt(tmp_path, {"sources.list": "# a comment\ndeb-src http://src.example bookworm main\n"
                          "deb [arch=amd64 signed-by=/k.gpg] http://mirror.example/debian "
                          "bookworm main\n"})
    assert debian_mirror("bookworm", apt) == "http://mirror.example/debian"


def test_deb822_sources(tmp_path):
    apt = _apt(tmp_path, {"sources.list.d/debian.sources":
                          "Types: deb\nURIs: http://deb822.example/debian\n"
                          "Suites: bookworm bookworm-updates\nComponents: main\n\n"
                          "Types: deb\nURIs: http://security.example\nSuites: bookworm-security\n"})
    assert debian_mirror("bookworm", apt) == "http://deb822.example/debian"


def test_no_source_for_the_suite_is_a_clear_error(tmp_path):
    apt = _apt(tmp_path, {"sources.list": "deb http://mirror.example/debian trixie main\n"})
    with pytest.raises(VmmgrError, match="no apt source for Debian bookworm"):
        debian_mirror("bookworm", apt)
