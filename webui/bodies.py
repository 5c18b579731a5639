"""The API's request bodies, one pydantic model each: the model validates the request and is the
OpenAPI document's schema for it, so the two cannot drift apart.

Strict: no coercion ("5" is not a number, true is not 1), unknown fields refused, and null means
"not given" (the document marks every optional field nullable). The core validates again, with
the same limits, whoever calls it.
"""

from typing import Annotated, Literal

from flask import request
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from vmmgr.errors import InvalidRequest
from vmmgr.policy import MAX_BANDWIDTH_MIBPS, POLICIES
from vmmgr.spec import (MAX_DISK_GIB, MAX_MEMORY_MIB, MAX_USER_DATA, MAX_VCPUS, MIN_MEMORY_MIB,
                        NAME_RE)
from vmmgr.workloads import WORKLOADS

Name = Annotated[str, Field(pattern=NAME_RE.pattern, max_length=63)]


class Body(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")


class Empty(Body):
    pass  # an action that needs nothing more than its path


class Create(Body):
    name: Name
    workload: Literal[tuple(WORKLOADS)] | None = None  # counter if not given
    params: dict[str, str] | None = None
    memory_mib: Annotated[int, Field(ge=MIN_MEMORY_MIB, le=MAX_MEMORY_MIB)] | None = None
    vcpus: Annotated[int, Field(ge=1, le=MAX_VCPUS)] | None = None
    host: Name | None = None
    gpu_model: Name | None = None
    gpu_count: Annotated[int, Field(ge=0, le=8)] | None = None
    group: Name | None = None  # a job's VMs move, park and resume together
    # A disk-backed VM from an OS image (instead of a built-in workload):
    image: Name | None = None
    disk_gib: Annotated[int, Field(ge=1, le=MAX_DISK_GIB)] | None = None
    ssh_keys: Annotated[list[Annotated[str, Field(max_length=16384)]],
                        Field(max_length=32)] | None = None
    user_data: Annotated[str, Field(max_length=MAX_USER_DATA)] | None = None
    local_disk: bool | None = None  # the disk on the host's own storage: it moves with the VM

    model_config = ConfigDict(json_schema_extra={"example": {
        "name": "train-1", "workload": "counter", "memory_mib": 128, "vcpus": 1,
        "host": "host1"}})


class Migrate(Body):
    target: Name
    policy: Literal[tuple(POLICIES)] | None = None
    bandwidth_mibps: Annotated[int, Field(ge=0, le=MAX_BANDWIDTH_MIBPS)] | None = None

    model_config = ConfigDict(json_schema_extra={"example": {"target": "host2"}})


class Reclaim(Body):
    deadline_s: Annotated[float, Field(gt=0, le=86400, allow_inf_nan=False)] | None = None

    model_config = ConfigDict(json_schema_extra={"example": {"deadline_s": 120}})


class Drain(Body):
    timeout: Annotated[float, Field(gt=0, le=86400, allow_inf_nan=False)] | None = None

    model_config = ConfigDict(json_schema_extra={"example": {"timeout": 300}})


class Resume(Body):
    host: Name | None = None

    model_config = ConfigDict(json_schema_extra={"example": {"host": "host3"}})


class Suspend(Body):
    mode: Literal["save", "guest"] | None = None


class Stop(Body):
    timeout: Annotated[float, Field(gt=0, le=3600)] | None = None  # s its OS gets (default 120)


def parse(model: type[Body]) -> dict:
    """The request's JSON body checked against `model`: the fields given, nulls left out."""
    raw = request.get_data()
    data = request.get_json(silent=True) if raw.strip() else {}
    if not isinstance(data, dict):
        raise InvalidRequest("the body must be a JSON object")
    try:
        return model.model_validate(data).model_dump(exclude_none=True)
    except ValidationError as err:
        raise InvalidRequest(_say(err)) from None


KINDS = {"int": "an integer", "float": "a number", "string": "a string", "dict": "an object",
         "bool": "true or false"}
NAMES = {"name": "VM name", "host": "host name", "target": "host name",
         "gpu_model": "device model", "group": "group name"}


def _say(err: ValidationError) -> str:
    """The first thing wrong, in the API's words: which field, and what it must be."""
    errors = err.errors(include_url=False)
    if any(e["type"] == "extra_forbidden" for e in errors):
        unknown = sorted(str(e["loc"][0]) for e in errors if e["type"] == "extra_forbidden")
        return f"unknown field(s): {', '.join(unknown)}"
    first = errors[0]
    loc = [str(part) for part in first["loc"]]
    field, kind, value = loc[0], first["type"], first.get("input")
    if kind == "missing":
        return f"field {field!r} is required"
    if len(loc) > 1:  # inside an object: params' values
        return f"field {field!r} must map names to strings"
    if kind.endswith(("_type", "_parsing")) and kind.split("_")[0] in KINDS:
        return f"field {field!r} must be {KINDS[kind.split('_')[0]]}"
    if kind in ("string_pattern_mismatch", "string_too_long") and field in NAMES:
        return (f"invalid {NAMES[field]} {value!r}: use 1-63 letters, digits, '.', '_' or '-', "
                "starting with a letter or digit")
    if kind == "literal_error":
        return f"unknown {field} {value!r} (known: {first['ctx']['expected']})"
    return f"field {field!r}: {first['msg'].lower().replace('input ', '')}"


def openapi_schema(model: type[Body]) -> dict:
    """The model's JSON Schema (2020-12) in OpenAPI 3.0's dialect: `nullable` for
    `anyOf [X, null]` (with null in an enum, as 3.0.3 asks), boolean exclusive bounds, no const,
    no titles."""
    return _openapi(model.model_json_schema())


def _openapi(node):
    if isinstance(node, list):
        return [_openapi(n) for n in node]
    if not isinstance(node, dict):
        return node
    node = {k: _openapi(v) for k, v in node.items() if k != "title"}
    options = node.get("anyOf")
    if options and {"type": "null"} in options:
        rest = [o for o in options if o != {"type": "null"}]
        node.pop("anyOf")
        node.pop("default", None)  # a null default: "not given", as the description says
        node = (rest[0] if len(rest) == 1 else {"anyOf": rest}) | node | {"nullable": True}
        if "enum" in node:
            node["enum"] = [*node["enum"], None]
    if "const" in node:  # 3.0 has no const: a one-value enum
        node["enum"] = [node.pop("const")]
    for bound, plain in (("exclusiveMinimum", "minimum"), ("exclusiveMaximum", "maximum")):
        if isinstance(node.get(bound), (int, float)) and not isinstance(node[bound], bool):
            node[plain], node[bound] = node[bound], True
    return node
