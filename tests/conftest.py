import os

import pytest


def pytest_addoption(parser):
    parser.addoption("--regen-golden", action="store_true",
                     help="rewrite tests/golden/* from the current templates (then review the diff)")


@pytest.fixture
def regen_golden(request) -> bool:
    return request.config.getoption("--regen-golden") or os.environ.get("VMMGR_REGEN_GOLDEN") == "1"
