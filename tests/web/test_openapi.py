"""schemathesis against the served OpenAPI document: generated requests (valid and invalid) to
every operation, as an admin, against a private Redis and an empty inventory. No 500s, and every
response matches what the document promises (status, content type, schema)."""

import shutil
import tempfile
from pathlib import Path

import hypothesis
import pytest
import schemathesis
from schemathesis.specs.openapi import checks as openapi_checks

from tests.conftest import private_redis
from vmmgr.paths import Paths
from vmmgr.users import Users
from webui import create_app

# schemathesis reads the document when the module loads, so the app exists before any fixture;
# its state directory is filled (Redis URL, admin token) by the fixture below.
HOME = Paths(Path(tempfile.mkdtemp(prefix="vmmgr-openapi-")))
schema = schemathesis.openapi.from_wsgi("/api/v1/openapi.json", create_app(HOME, TESTING=True))


@pytest.fixture(scope="module")
def admin_token():
    try:
        with private_redis(HOME.home) as url:
            HOME.redis_url_file.write_text(url)
            Users(HOME.users).add("admin", "a long enough password", "admin")
            yield Users(HOME.users).new_token("admin")
    finally:
        shutil.rmtree(HOME.home, ignore_errors=True)


@schema.parametrize()
# Derandomized: the same cases every run. A negative case whose only fault is a missing
# Authorization header becomes valid once the token is added below; at random, 1 run in 4 drew
# such a case with its query's fault lost in encoding, and failed on a correct answer.
@hypothesis.settings(max_examples=40, deadline=None, derandomize=True,
                     suppress_health_check=list(hypothesis.HealthCheck))
def test_the_api_honours_its_document(case, admin_token):
    # A valid request can still be refused by the fleet's state (409: no room, busy): the
    # document says so, and status conformance checks it; "valid means 2xx" does not hold here.
    case.call_and_validate(headers={"Authorization": f"Bearer {admin_token}"},
                           excluded_checks=[openapi_checks.positive_data_acceptance])
