"""MkDocs hook: the API reference pages, written at build time from the service's OpenAPI schema.

The schema is what `python manage.py spectacular` writes (drf-spectacular reads it off the views and
serializers), so the pages cannot drift from the code. They are plain Markdown: nothing is fetched
when the site is viewed. The schema itself is published next to them as `api/openapi.json`.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from http import HTTPStatus
from pathlib import Path
from typing import Any

from mkdocs.exceptions import PluginError
from mkdocs.structure.files import File, Files

ROOT = Path(__file__).resolve().parents[2]
PREFIX = "/api/v1"
SCHEMAS_PAGE = "schemas.md"
METHODS = ("get", "put", "post", "patch", "delete")


@dataclass(frozen=True)
class Group:
    slug: str
    title: str
    intro: str
    prefixes: tuple[str, ...]  # an operation belongs to the first group one of whose prefixes its path has


# Order matters: the first group with a matching prefix wins; what matches none lands on the last
# (tasks) page, so a new route is never left out of the reference.
GROUPS = (
    Group(
        "maintenance",
        "Maintenance",
        "Routes for maintainer tokens only ([Projects and tokens](../../operations/projects.md)): each "
        "is written to the audit log, and a trainer token gets 403 `maintainer_required`.",
        (
            "/tasks/{task_id}/flush",
            "/tasks/{task_id}/nodes/{node_id}/evict",
            "/tasks/{task_id}/nodes/{node_id}/pin",
        ),
    ),
    Group(
        "client-mode",
        "Lookup and record (client mode)",
        "What a trainer that owns its sandboxes calls: look a call up, record what it ran, register "
        "the snapshots the service asks for, release leases and claims. How they fit together: "
        "[Client mode in depth](../../design/client-mode.md).",
        (
            "/tasks/{task_id}/lookup",
            "/tasks/{task_id}/record",
            "/tasks/{task_id}/file-times",
            "/tasks/{task_id}/claims",
            "/tasks/{task_id}/nodes",
            "/leases",
        ),
    ),
    Group(
        "tool-server",
        "Tool-server mode",
        "What a trainer calls when the service runs the sandboxes: a rollout's calls, its end, the "
        "announcement of a training step and the pools. How misses run: "
        "[Sandboxes, snapshots and tool-server mode](../../design/sandboxes.md).",
        ("/tasks/{task_id}/rollouts", "/steps", "/pools"),
    ),
    Group(
        "upstreams",
        "Upstreams (the verl-tool proxy)",
        "Register a verl-tool tool server once; its trainers then talk to the proxy URL the answer "
        "gives. How the proxy answers: [verl-tool](../../integrations/verl-tool.md).",
        ("/upstreams",),
    ),
    Group(
        "tasks",
        "Tasks",
        "Put a task (its environment spec, tool policy and sandbox budget), list and read tasks with "
        "their statistics, graph and sandboxes.",
        ("/tasks",),
    ),
)


def on_files(files: Files, config: Any) -> Files:
    schema = openapi_schema()
    operations = grouped_operations(schema)
    for group in GROUPS:
        content = group_page(group, operations[group.slug], schema)
        files.append(File.generated(config, f"api/reference/{group.slug}.md", content=content))
    files.append(File.generated(config, f"api/reference/{SCHEMAS_PAGE}", content=schemas_page(schema)))
    files.append(File.generated(config, "api/openapi.json", content=json.dumps(schema, indent=1)))
    return files


def openapi_schema() -> dict[str, Any]:
    """Runs `manage.py spectacular` with this interpreter, as the service's settings see it."""
    env = dict(os.environ, DJANGO_SETTINGS_MODULE="tvcache_site.settings")
    if not env.get("SECRET_KEY"):
        env["DEBUG"] = "1"  # the settings' development-only key: the schema needs no secret
    with tempfile.TemporaryDirectory() as folder:
        out = Path(folder) / "openapi.json"
        command = [sys.executable, "manage.py", "spectacular", "--format", "openapi-json", "--file", str(out)]
        done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
        if done.returncode != 0:
            raise PluginError(f"{' '.join(command)} failed ({done.returncode}):\n{done.stderr[-4000:]}")
        return json.loads(out.read_text())


def grouped_operations(schema: dict[str, Any]) -> dict[str, list[tuple[str, str, dict]]]:
    """Each group's operations in the order of its prefixes (a lookup before its record), then by path."""
    keyed: dict[str, list[tuple[int, str, str, dict]]] = {group.slug: [] for group in GROUPS}
    for path, methods in schema["paths"].items():
        short = path.removeprefix(PREFIX)
        group = next((g for g in GROUPS if short.startswith(g.prefixes)), GROUPS[-1])
        rank = next(i for i, prefix in enumerate(group.prefixes + ("",)) if short.startswith(prefix))
        for method, operation in methods.items():
            if method in METHODS:
                keyed[group.slug].append((rank, path, method.upper(), operation))
    ordered = {}
    for slug, ops in keyed.items():
        ops.sort(key=lambda o: (o[0], o[1], METHODS.index(o[2].lower())))
        ordered[slug] = [(method, path, op) for _, path, method, op in ops]
    return ordered


# --- pages ------------------------------------------------------------------------------------------


def group_page(group: Group, operations: list[tuple[str, str, dict]], schema: dict[str, Any]) -> str:
    lines = [
        f"# {group.title}",
        "",
        "<!-- Written at build time from the OpenAPI schema (docs/_hooks/api_pages.py); edit the views. -->",
        "",
        group.intro,
        "",
        "| Route | What it does |",
        "| --- | --- |",
    ]
    for method, path, op in operations:
        lines.append(f"| [`{method} {path}`](#{op['operationId']}) | {cell(op.get('summary', ''))} |")
    lines.append("")
    for method, path, op in operations:
        lines += operation_section(method, path, op, schema)
    return "\n".join(lines) + "\n"


def operation_section(method: str, path: str, op: dict[str, Any], schema: dict[str, Any]) -> list[str]:
    lines = [f"## `{method} {path}` {{ #{op['operationId']} }}", ""]
    if op.get("summary"):
        lines += [text(op["summary"]) + ("" if op["summary"].endswith(".") else "."), ""]
    if op.get("description"):
        lines += [text(op["description"]), ""]
    lines += [auth_line(op), ""]
    parameters = op.get("parameters", [])
    if parameters:
        lines += ["**Parameters**", "", "| Name | In | Type | Required | Description |"]
        lines += ["| --- | --- | --- | --- | --- |"]
        for p in parameters:
            lines.append(
                f"| `{p['name']}` | {p['in']} | {type_of(p.get('schema', {}))} | "
                f"{'yes' if p.get('required') else 'no'} | {cell(describe(p, p.get('schema', {})))} |"
            )
        lines.append("")
    body = op.get("requestBody", {}).get("content", {}).get("application/json")
    if body:
        lines += [f"**Request body** ({type_of(body['schema'])})", ""]
        lines += fields_table(body["schema"], schema)
        for name, example in body.get("examples", {}).items():
            lines += [f"Example: {example.get('summary', name)}", "", "```json"]
            lines += [json.dumps(example["value"], indent=2), "```", ""]
    lines += responses(op, schema)
    return lines


def auth_line(op: dict[str, Any]) -> str:
    schemes = [name for requirement in op.get("security", []) for name in requirement]
    if not schemes:
        return "**Auth**: none."
    return "**Auth**: `Authorization: Token <key>`, a token of the task's project."


def responses(op: dict[str, Any], schema: dict[str, Any]) -> list[str]:
    lines: list[str] = []
    errors: list[str] = []
    for status, answer in op.get("responses", {}).items():
        body = answer.get("content", {}).get("application/json", {}).get("schema")
        if status.startswith(("4", "5")) and body == {"$ref": "#/components/schemas/Error"}:
            errors.append(status)
            continue
        heading = f"**{status} {reason(status)}**"
        if answer.get("description"):
            heading += f": {text(answer['description'])}"
        lines += [heading, ""]
        if body:
            lines += [f"Body: {type_of(body)}", ""]
            lines += fields_table(body, schema)
    if errors:
        lines += [
            f"**Errors**: {', '.join(errors)}, each with an [Error]({SCHEMAS_PAGE}#schema-Error) body "
            "(the codes: [API overview](../index.md#errors)).",
            "",
        ]
    return lines


def schemas_page(schema: dict[str, Any]) -> str:
    lines = [
        "# Schemas",
        "",
        "<!-- Written at build time from the OpenAPI schema (docs/_hooks/api_pages.py). -->",
        "",
        "The bodies the routes take and answer. The whole schema, as `python manage.py spectacular` "
        "writes it: [openapi.json](../openapi.json).",
        "",
    ]
    for name, definition in schema.get("components", {}).get("schemas", {}).items():
        lines += [f"## {name} {{ #schema-{name} }}", ""]
        if definition.get("description"):
            lines += [text(definition["description"]), ""]
        if definition.get("enum"):
            lines += ["One of " + ", ".join(f"`{v}`" for v in definition["enum"]) + ".", ""]
        else:
            fields = fields_table(definition, schema, here=True)
            lines += fields or [f"Type: {type_of(definition, here=True)}", ""]
    return "\n".join(lines) + "\n"


def fields_table(definition: dict[str, Any], schema: dict[str, Any], here: bool = False) -> list[str]:
    resolved = resolve(definition, schema)
    properties = resolved.get("properties")
    if not properties:
        return []
    required = set(resolved.get("required", []))
    lines = ["| Field | Type | Required | Description |", "| --- | --- | --- | --- |"]
    for name, prop in properties.items():
        needed = "yes" if name in required else "no"
        lines.append(f"| `{name}` | {type_of(prop, here)} | {needed} | {cell(describe(prop, prop))} |")
    return lines + [""]


# --- types and text ---------------------------------------------------------------------------------


def resolve(definition: dict[str, Any], schema: dict[str, Any]) -> dict[str, Any]:
    ref = definition.get("$ref")
    if ref:
        return schema["components"]["schemas"][ref.rsplit("/", 1)[1]]
    return definition


def type_of(definition: dict[str, Any], here: bool = False) -> str:
    nullable = ", or null" if definition.get("nullable") else ""
    ref = definition.get("$ref")
    if ref:
        name = ref.rsplit("/", 1)[1]
        return f"[{name}]({'' if here else SCHEMAS_PAGE}#schema-{name}){nullable}"
    for key, joiner in (("allOf", " and "), ("oneOf", " or "), ("anyOf", " or ")):
        if key in definition:
            return joiner.join(type_of(part, here) for part in definition[key]) + nullable
    if "enum" in definition:
        return "one of " + ", ".join(f"`{v}`" for v in definition["enum"] if v is not None) + nullable
    kind = definition.get("type")
    if kind == "array":
        return f"array of {type_of(definition.get('items', {}), here)}{nullable}"
    if kind == "object":
        extra = definition.get("additionalProperties")
        if isinstance(extra, dict) and extra:
            return f"object of {type_of(extra, here)}{nullable}"
        return f"object{nullable}"
    if kind is None:
        return f"any JSON{nullable}"
    fmt = definition.get("format")
    return f"{kind}{f' ({fmt})' if fmt and fmt not in {'double', 'float'} else ''}{nullable}"


BOUNDS = (
    ("minimum", "at least {}"),
    ("maximum", "at most {}"),
    ("minLength", "at least {} character{}"),
    ("maxLength", "at most {} character{}"),
    ("minItems", "at least {} item{}"),
    ("maxItems", "at most {} item{}"),
    ("pattern", "matching `{}`"),
    ("default", "default `{}`"),
)


def describe(outer: dict[str, Any], definition: dict[str, Any]) -> str:
    description = outer.get("description") or definition.get("description") or ""
    # drf-spectacular appends an enum's values as a bullet list; the type column already names them.
    description = description.split("\n\n* `")[0]
    bounds = [
        bound(template, json.dumps(definition[key]) if key == "default" else definition[key])
        for key, template in BOUNDS
        if key in definition
    ]
    if bounds and description:
        description = f"{description} ({', '.join(bounds)})"
    elif bounds:
        description = ", ".join(bounds).capitalize()
    return description


def bound(template: str, value: Any) -> str:
    return template.format(value, "" if value == 1 else "s")


def reason(status: str) -> str:
    try:
        return HTTPStatus(int(status)).phrase
    except ValueError:
        return ""


def text(value: str) -> str:
    return value.strip()


def cell(value: str) -> str:
    return value.strip().replace("|", "\\|").replace("\n\n", "<br>").replace("\n", " ")
