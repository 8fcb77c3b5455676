"""The OpenAPI schema of each body that cache/inputs.py parses says what its parser does: the same
fields, the same required ones, the same types and the same ranges. No serializer validates these
bodies (the hot endpoints cannot afford one), so this is what keeps the published schema and the
validation from drifting apart: a field added, dropped or bounded on one side only fails here.

Each check starts from a body the schema calls valid, which the parser must accept, and changes one
thing. A null in an optional field means "absent" to the parsers, as the schema's defaults say, so
only required fields are probed with null."""

from __future__ import annotations

import copy
from typing import Any

import pytest
from drf_spectacular.generators import SchemaGenerator

from cache import inputs
from core.errors import ApplicationError
from core.ttl import RecentMemo

# Request body component -> the parser its endpoint validates it with, and nothing else.
PARSERS = {
    "Lookup": inputs.parse_lookup,
    "Record": inputs.parse_record,
    "ClaimRelease": inputs.parse_claim_release,
    "Call": inputs.parse_rollout_call,
    "TaskPut": inputs.parse_task,
    "FileTimesQuery": inputs.parse_file_times_query,
}
OPERATIONS = {
    ("post", "/api/v1/tasks/{task_id}/lookup"): "Lookup",
    ("post", "/api/v1/tasks/{task_id}/record"): "Record",
    ("post", "/api/v1/tasks/{task_id}/claims/release"): "ClaimRelease",
    ("post", "/api/v1/tasks/{task_id}/rollouts/{rollout_id}/calls"): "Call",
    ("put", "/api/v1/tasks/{task_id}"): "TaskPut",
    ("post", "/api/v1/tasks/{task_id}/file-times"): "FileTimesQuery",
}
# A value of each JSON type, and the schema types it is one of.
SAMPLES = [
    ("x", {"string"}),
    (1, {"integer", "number"}),
    (1.5, {"number"}),
    (True, {"boolean"}),
    ({}, {"object"}),
    ([], {"array"}),
    (None, set()),
]


@pytest.fixture(autouse=True)
def _parsed_afresh(monkeypatch):
    """What the parsers read, not what their memo of parsed histories remembers: a history parsed
    once is parsed again from the memo, reading none of its fields."""
    monkeypatch.setattr("cache.inputs._parsed_histories", RecentMemo(0))


@pytest.fixture(scope="module")
def schema() -> dict:
    return SchemaGenerator().get_schema(request=None, public=True)


def resolved(schema: dict, node: dict) -> dict:
    while "$ref" in node or len(node.get("allOf", ())) == 1:
        node = node["allOf"][0] if "allOf" in node else node
        if "$ref" in node:
            node = schema["components"]["schemas"][node["$ref"].rsplit("/", 1)[1]]
    return node


def example(schema: dict, node: dict) -> Any:
    """A value the schema calls valid: every property present, numbers at their minimum."""
    node = resolved(schema, node)
    kind = node.get("type")
    if "enum" in node:
        return node["enum"][0]
    if kind == "object":
        if "properties" in node:
            return {name: example(schema, prop) for name, prop in node["properties"].items()}
        extra = node.get("additionalProperties")
        return {"k": example(schema, extra) if extra else 1}
    if kind == "array":
        return [example(schema, node["items"])] * max(1, node.get("minItems", 1))
    if kind in ("integer", "number"):
        return node.get("minimum", 0)
    if kind == "string":
        return "x" * max(1, node.get("minLength", 0))
    if kind == "boolean":
        return False  # a lookup's claim would need a rollout id
    return {"any": [1]}  # a JSON value of any type


def objects(schema: dict, node: dict, path: tuple = ()) -> list[tuple[tuple, dict]]:
    """(path in the example, schema) of every object with declared properties in a body."""
    node = resolved(schema, node)
    found = []
    if node.get("type") == "object" and "properties" in node:
        found.append((path, node))
        for name, prop in node["properties"].items():
            found += objects(schema, prop, (*path, name))
    elif node.get("type") == "object" and node.get("additionalProperties"):
        found += objects(schema, node["additionalProperties"], (*path, "k"))
    elif node.get("type") == "array":
        found += objects(schema, node["items"], (*path, 0))
    return found


class Reads(dict):
    """An object that notes which of its fields a parser asked for."""

    def __init__(self, *args):
        super().__init__(*args)
        self.asked: set[str] = set()

    def get(self, key, default=None):
        self.asked.add(key)
        return super().get(key, default)

    def __getitem__(self, key):
        self.asked.add(key)
        return super().__getitem__(key)

    def __contains__(self, key):
        self.asked.add(key)
        return super().__contains__(key)


def at(body: dict, path: tuple, value_of) -> dict:
    """A copy of `body` whose object at `path` is replaced by `value_of(that object)`."""
    body = copy.deepcopy(body)
    if not path:
        return value_of(body)
    holder = body
    for key in path[:-1]:
        holder = holder[key]
    holder[path[-1]] = value_of(holder[path[-1]])
    return body


def accepts(parse, body) -> bool:
    try:
        parse(body)
    except ApplicationError as exc:
        assert exc.status in (400, 413), exc
        return False
    return True


def test_each_parsed_body_is_the_request_body_of_its_operation(schema):
    for (method, path), component in OPERATIONS.items():
        body = schema["paths"][path][method]["requestBody"]["content"]["application/json"]["schema"]
        assert body == {"$ref": f"#/components/schemas/{component}"}, (method, path)
    assert set(OPERATIONS.values()) == set(PARSERS)


@pytest.mark.parametrize("component", PARSERS)
def test_the_schema_and_the_parser_say_the_same(schema, component):
    parse = PARSERS[component]
    root = schema["components"]["schemas"][component]
    valid = example(schema, root)
    assert accepts(parse, valid), valid
    drift = []
    for path, node in objects(schema, root):
        where = ".".join(map(str, (component, *path)))
        properties, required = node["properties"], set(node.get("required", ()))

        wrapped = at(valid, path, Reads)
        parse(wrapped)
        asked = (wrapped if not path else _get(wrapped, path)).asked
        if asked != set(properties):
            drift.append(f"{where}: the parser reads {sorted(asked)}, the schema has {sorted(properties)}")

        for name, prop in properties.items():
            field = f"{where}.{name}"
            without = at(valid, path, lambda obj: {k: v for k, v in obj.items() if k != name})
            if accepts(parse, without) == (name in required):
                drift.append(f"{field}: required in {'the schema' if name in required else 'the parser'} only")
            prop = resolved(schema, prop)
            kind = prop.get("type")
            if kind is None:
                continue  # any JSON value
            for value, kinds in SAMPLES:  # values of the other types (the example has one of its own)
                if kind in kinds or value is None and (name not in required or prop.get("nullable")):
                    continue
                if accepts(parse, at(valid, (*path, name), lambda _: value)):
                    drift.append(f"{field}: {value!r} is accepted for a {kind}")
            for value, admitted in _bounds(prop):
                if accepts(parse, at(valid, (*path, name), lambda _: value)) != admitted:
                    drift.append(
                        f"{field}: {str(value)[:20]!r} is {'refused' if admitted else 'accepted'} "
                        f"against the schema's bounds"
                    )
    assert drift == []


def _get(body, path: tuple):
    for key in path:
        body = body[key]
    return body


def _bounds(prop: dict) -> list[tuple[Any, bool]]:
    """Values at and just beyond the schema's bounds, or far out where it states none: (value,
    the schema admits it)."""
    kind = prop.get("type")
    if "enum" in prop:  # each member, and a string that is none
        return [(value, True) for value in prop["enum"]] + [("none-of-them", False)]
    probes = []
    if kind in ("integer", "number"):
        far = 2**62 if kind == "integer" else 1e300
        probes += [(prop["minimum"], True), (prop["minimum"] - 1, False)] if "minimum" in prop else [(-far, True)]
        probes += [(prop["maximum"], True), (prop["maximum"] + 1, False)] if "maximum" in prop else [(far, True)]
    if kind == "string":
        shortest = prop.get("minLength", 0)
        probes += [("x" * shortest, True)] + ([("x" * (shortest - 1), False)] if shortest else [])
        probes += (
            [("x" * prop["maxLength"], True), ("x" * (prop["maxLength"] + 1), False)]
            if "maxLength" in prop
            else [("x" * 10_000, True)]
        )
    return probes
