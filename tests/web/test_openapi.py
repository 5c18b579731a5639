"""schemathesis against the served OpenAPI document: generated requests (valid and invalid) to
every operation, as an admin, against a private Redis and an empty inventory. No 500s, and every
response matches what the document promises (status, content type, schema)."""

import atexit
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
atexit.register(shutil.rmtree, HOME.home, True)  # also where no test here runs (a -k, a crash)
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
# Derandomized: the same cases every run (which cases still shifts with what ran before).
@hypothesis.settings(max_examples=40, deadline=None, derandomize=True,
                     suppress_health_check=list(hypothesis.HealthCheck))
def test_the_api_honours_its_document(case, admin_token):
    # The admin's token stands in for the Authorization a case carries; a negative case made by
    # leaving it out goes without (given one, a case whose other fault was lost in encoding
    # became valid, and failed on a correct answer). A valid request can still be refused by
    # the fleet's state (409: no room, busy): the document says so, and status conformance
    # checks it; "valid means 2xx" does not hold here.
    carries = any(k.lower() == "authorization" for k in (case.headers or {}))
    case.call_and_validate(headers={"Authorization": f"Bearer {admin_token}"} if carries else {},
                           excluded_checks=[openapi_checks.positive_data_acceptance])


def test_each_body_is_documented_by_the_model_that_validates_it():
    """One schema per body: the document shows the pydantic model the route validates with, in
    OpenAPI 3.0's dialect (nullable, null in enums, boolean exclusive bounds, no titles)."""
    from webui import bodies
    from webui.openapi import document

    paths = document()["paths"]
    documented = {(path, method): op["requestBody"]["content"]["application/json"]["schema"]
                  for path, item in paths.items() for method, op in item.items()
                  if isinstance(op, dict) and "requestBody" in op}
    assert documented[("/vms", "post")] == bodies.openapi_schema(bodies.Create)
    assert documented[("/vms/{name}/migrate", "post")] == bodies.openapi_schema(bodies.Migrate)
    suspend = documented[("/vms/{name}/suspend", "post")]["properties"]["mode"]
    assert suspend == {"type": "string", "enum": ["save", "guest", None], "nullable": True}
    timeout = documented[("/hosts/{name}/drain", "post")]["properties"]["timeout"]
    assert timeout["minimum"] == 0 and timeout["exclusiveMinimum"] is True
    assert "title" not in str(documented) and "anyOf" not in str(documented)
    for schema in documented.values():
        assert schema["additionalProperties"] is False
        if "example" in schema:  # every example the document gives is a valid request
            model = next(m for m in (bodies.Create, bodies.Migrate, bodies.Drain, bodies.Resume,
                                     bodies.Reclaim)
                         if bodies.openapi_schema(m) == schema)
            model.model_validate(schema["example"])
