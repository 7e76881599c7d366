"""Wire schemas per provider dialect (SPEC §11, finding #1). Pure functions, no I/O.

Every tool offered to a model goes through :func:`wire_tool`, which turns the MCP server's ``inputSchema`` into a
schema the provider accepts, then validates every example (tool-level ``inputExamples``, schema-level
``examples``/``example`` and ``default`` values) against the FINAL wire schema and drops those that fail.

Common steps (all dialects): deep copy; ``$schema``/``$id`` dropped; draft-04/06/07 constructs rewritten to
2020-12 (``definitions`` → ``$defs``, tuple ``items`` → ``prefixItems``, ``dependencies``, boolean
``exclusiveMinimum``, ``$ref`` siblings that draft-07 ignores); dangling ``$ref`` → ``{}``; a root that is not a
plain object (missing ``type``, ``oneOf``/``anyOf``/``allOf`` at the top, which Anthropic and OpenAI reject) is
merged into one object that accepts everything the original accepted.

- ``anthropic``: draft 2020-12 as is. Objects are never closed by us: an explicit ``additionalProperties: true``
  (or ``{}``) survives, ``$ref``/``$defs`` stay (local refs resolve).
- ``openai``: like anthropic, plus every array gets ``items`` (OpenAI rejects "array schema missing items").
- ``openai-strict``: structured-outputs rules: every object closed with every property required (optional ones
  become nullable), only the supported keywords, ``oneOf`` → ``anyOf``, no root combinator. A schema that cannot
  be made strict without changing its meaning (an open object, a typed map, an untyped value, an array without
  ``items``, depth > 10, > 5,000 properties) is sent non-strict (``strict: false``) with the ``openai`` rules.
- ``gemini``: the OpenAPI 3.0 subset of ``FunctionDeclaration.parameters``: refs inlined, ``type`` lists →
  ``nullable``/``anyOf``, ``const`` → ``enum``, only string enums, only the supported formats, no
  ``additionalProperties``; an object without properties (open or typed map) and an untyped value become a JSON
  string (Gemini rejects an OBJECT with no properties); :func:`coerce_arguments` decodes it on the way back. A tool
  without parameters has ``inputSchema: None`` (the declaration then has no ``parameters``).
"""

from __future__ import annotations

import copy
import json
import math
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, Literal

from jsonschema import Draft7Validator, Draft202012Validator
from referencing import Registry, Resource
from referencing.jsonschema import DRAFT202012

Dialect = Literal["anthropic", "openai", "openai-strict", "gemini"]
DIALECTS: tuple[Dialect, ...] = ("anthropic", "openai", "openai-strict", "gemini")

# keyword → how its value holds subschemas
MAP_KEYS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
ONE_KEYS = ("items", "additionalProperties", "not", "contains", "propertyNames", "if", "then", "else",
            "unevaluatedItems", "unevaluatedProperties", "additionalItems")
LIST_KEYS = ("anyOf", "oneOf", "allOf", "prefixItems")
ANNOTATIONS = ("title", "description", "default", "examples", "example", "deprecated", "readOnly", "writeOnly",
               "$comment")
OLD_DRAFTS = ("draft-04", "draft-06", "draft-07")

STRICT_KEYWORDS = {"type", "properties", "required", "additionalProperties", "items", "enum", "const", "anyOf",
                   "$ref", "$defs", "description", "title", "pattern", "format", "minimum", "maximum",
                   "exclusiveMinimum", "exclusiveMaximum", "multipleOf", "minItems", "maxItems"}
STRICT_FORMATS = {"date-time", "time", "date", "duration", "email", "hostname", "ipv4", "ipv6", "uuid"}
STRICT_MAX_DEPTH = 10
STRICT_MAX_PROPERTIES = 5000
STRICT_MAX_ENUM_VALUES = 1000

GEMINI_KEYWORDS = {"type", "format", "title", "description", "nullable", "enum", "maxItems", "minItems",
                   "properties", "required", "minProperties", "maxProperties", "minLength", "maxLength",
                   "pattern", "example", "anyOf", "items", "minimum", "maximum", "propertyOrdering"}
GEMINI_TYPES = ("string", "number", "integer", "boolean", "array", "object")
GEMINI_FORMATS = {"string": {"enum", "date-time"}, "integer": {"int32", "int64"}, "number": {"float", "double"}}
JSON_OBJECT_NOTE = "a JSON object, encoded as a string"
JSON_ARRAY_NOTE = "a JSON array, encoded as a string"
JSON_VALUE_NOTE = "any JSON value, encoded as a string"


# ---------------------------------------------------------------- walking
def children(node: Mapping[str, Any]) -> Iterator[tuple[str, Any]]:
    """(JSON-pointer suffix, subschema) for every direct subschema of ``node``."""
    for key in MAP_KEYS:
        sub = node.get(key)
        if isinstance(sub, Mapping):
            for name, s in sub.items():
                yield f"/{key}/{_esc(name)}", s
    for key in ONE_KEYS:
        sub = node.get(key)
        if isinstance(sub, (Mapping, bool)):
            yield f"/{key}", sub
        elif key == "items" and isinstance(sub, list):  # draft-07 tuple form
            for i, s in enumerate(sub):
                yield f"/items/{i}", s
    for key in LIST_KEYS:
        sub = node.get(key)
        if isinstance(sub, list):
            for i, s in enumerate(sub):
                yield f"/{key}/{i}", s


def walk(schema: Any, pointer: str = "") -> Iterator[tuple[str, dict[str, Any]]]:
    """Every (pointer, subschema dict) of a schema, the root first."""
    if not isinstance(schema, dict):
        return
    yield pointer, schema
    for suffix, sub in children(schema):
        yield from walk(sub, pointer + suffix)


def map_schema(node: Any, fn: Callable[[dict[str, Any]], Any]) -> Any:
    """Bottom-up rewrite: children first, then ``fn`` on the node (returns the replacement)."""
    if not isinstance(node, dict):
        return node
    out = dict(node)
    for key in MAP_KEYS:
        if isinstance(out.get(key), dict):
            out[key] = {k: map_schema(v, fn) for k, v in out[key].items()}
    for key in ONE_KEYS:
        if isinstance(out.get(key), dict):
            out[key] = map_schema(out[key], fn)
        elif key == "items" and isinstance(out.get(key), list):
            out[key] = [map_schema(v, fn) for v in out[key]]
    for key in LIST_KEYS:
        if isinstance(out.get(key), list):
            out[key] = [map_schema(v, fn) for v in out[key]]
    return fn(out)


def _esc(name: str) -> str:
    return name.replace("~", "~0").replace("/", "~1")


def _unesc(part: str) -> str:
    return part.replace("~1", "/").replace("~0", "~")


def resolve_pointer(root: Any, ref: str) -> Any:
    """The target of a local ``$ref`` (``#`` or ``#/a/b``); None when it does not resolve."""
    if not ref.startswith("#"):
        return None
    frag = ref[1:]
    if frag == "":
        return root
    if not frag.startswith("/"):
        return None
    cur = root
    for raw in frag[1:].split("/"):
        part = _unesc(raw)
        if isinstance(cur, dict) and part in cur:
            cur = cur[part]
        elif isinstance(cur, list) and part.isdigit() and int(part) < len(cur):
            cur = cur[int(part)]
        else:
            return None
    return cur


def deref(root: Any, node: Any, limit: int = 32) -> Any:
    """Follow ``$ref`` chains (local only)."""
    seen = 0
    while isinstance(node, dict) and isinstance(node.get("$ref"), str) and seen < limit:
        target = resolve_pointer(root, node["$ref"])
        if target is None:
            return {}
        node, seen = target, seen + 1
    return node


def types_of(node: Any) -> list[str] | None:
    """The node's ``type`` keyword as a list (None when absent)."""
    if not isinstance(node, dict) or "type" not in node:
        return None
    t = node["type"]
    return [t] if isinstance(t, str) else [x for x in t if isinstance(x, str)] if isinstance(t, list) else None


# ---------------------------------------------------------------- normalisation (all dialects)
def normalize(schema: Any) -> dict[str, Any]:
    """A 2020-12 object schema without ``$schema``, equivalent to (or more permissive than) the input."""
    if not isinstance(schema, dict):
        return {"type": "object", "properties": {}}
    doc = copy.deepcopy(schema)
    draft = str(doc.get("$schema", ""))
    if any(d in draft for d in OLD_DRAFTS):
        doc = _from_old_draft(doc)
    doc.pop("$schema", None)
    doc.pop("$id", None)
    doc = _fix_refs(doc)
    return _flatten_root(doc)


def _from_old_draft(doc: dict[str, Any]) -> dict[str, Any]:
    def fix(node: dict[str, Any]) -> dict[str, Any]:
        node.pop("$schema", None)
        if "$ref" in node:  # draft-07: siblings of $ref are ignored; keep annotations only
            node = {k: v for k, v in node.items() if k == "$ref" or k in ANNOTATIONS}
        if isinstance(node.get("items"), list):
            node["prefixItems"] = node.pop("items")
            if "additionalItems" in node:
                node["items"] = node.pop("additionalItems")
        else:
            node.pop("additionalItems", None)
        deps = node.pop("dependencies", None)
        if isinstance(deps, dict):
            req = {k: v for k, v in deps.items() if isinstance(v, list)}
            sch = {k: v for k, v in deps.items() if isinstance(v, (dict, bool))}
            if req:
                node["dependentRequired"] = req
            if sch:
                node["dependentSchemas"] = sch
        for excl, bound in (("exclusiveMinimum", "minimum"), ("exclusiveMaximum", "maximum")):
            if isinstance(node.get(excl), bool):
                if node[excl] and bound in node:
                    node[excl] = node.pop(bound)
                else:
                    node.pop(excl)
        return node

    doc = map_schema(doc, fix)
    if isinstance(doc.get("definitions"), dict):
        defs = doc.pop("definitions")
        doc["$defs"] = {**defs, **doc.get("$defs", {})}

        def reref(node: dict[str, Any]) -> dict[str, Any]:
            ref = node.get("$ref")
            if isinstance(ref, str) and ref.startswith("#/definitions/"):
                node["$ref"] = "#/$defs/" + ref[len("#/definitions/"):]
            return node

        doc = map_schema(doc, reref)
    return doc


def _fix_refs(doc: dict[str, Any]) -> dict[str, Any]:
    def fix(node: dict[str, Any]) -> dict[str, Any]:
        node.pop("$id", None)
        node.pop("$schema", None)
        ref = node.get("$ref")
        if ref is not None and (not isinstance(ref, str) or resolve_pointer(doc, ref) is None):
            node = {k: v for k, v in node.items() if k != "$ref"}
        return node

    return map_schema(doc, fix)


def _flatten_root(doc: dict[str, Any]) -> dict[str, Any]:
    """Make the root a plain ``type: object`` schema (no top-level combinator)."""
    t = types_of(doc)
    if (t is not None and "object" in t) or t is None or not t:
        doc["type"] = "object"
    else:  # a non-object root (not allowed by MCP): accept any object
        return {k: v for k, v in doc.items() if k in ("title", "description", "$defs")} | {"type": "object"}
    for key in ("allOf", "anyOf", "oneOf"):
        branches = doc.pop(key, None)
        if isinstance(branches, list) and branches:
            doc = _merge_branches(doc, [deref(doc, b) for b in branches], all_of=key == "allOf")
    if "properties" not in doc and doc.get("additionalProperties") is not False:
        doc.setdefault("properties", {})
    return doc


def _merge_branches(base: dict[str, Any], branches: list[Any], *, all_of: bool) -> dict[str, Any]:
    """Fold object branches into ``base``: properties united (a name in several branches → anyOf of them),
    required united (allOf) or intersected (anyOf/oneOf); closed only when every part is closed."""
    props: dict[str, list[Any]] = {k: [v] for k, v in (base.get("properties") or {}).items()}
    base_req = list(base.get("required") or [])
    reqs: list[set[str]] = []
    closed = [base.get("additionalProperties") is False] if "properties" in base else []
    for b in branches:
        if not isinstance(b, dict):
            closed.append(False)
            reqs.append(set())
            continue
        for k, v in (b.get("properties") or {}).items():
            if not any(v == x for x in props.setdefault(k, [])):
                props[k].append(v)
        reqs.append(set(b.get("required") or []))
        closed.append(b.get("additionalProperties") is False)
    out = {k: v for k, v in base.items() if k not in ("properties", "required", "additionalProperties")}
    out["properties"] = {k: (vs[0] if len(vs) == 1 else {"anyOf": vs}) for k, vs in props.items()}
    if all_of:
        req = set(base_req).union(*reqs) if reqs else set(base_req)
    else:
        req = set(base_req) | (set.intersection(*reqs) if reqs else set())
    if req:
        out["required"] = [k for k in out["properties"] if k in req]
    if closed and all(closed):
        out["additionalProperties"] = False
    elif any(b.get("additionalProperties") is True for b in branches if isinstance(b, dict)) or \
            base.get("additionalProperties") is True:
        out["additionalProperties"] = True
    return out


# ---------------------------------------------------------------- dialects
def to_anthropic(schema: Any) -> dict[str, Any]:
    return normalize(schema)


def to_openai(schema: Any) -> dict[str, Any]:
    def items(node: dict[str, Any]) -> dict[str, Any]:
        t = types_of(node)
        if t and "array" in t and "items" not in node and "prefixItems" not in node:
            node["items"] = {}
        return node

    return map_schema(normalize(schema), items)


class NotStrict(Exception):
    """The schema cannot be made strict without changing what it accepts."""


def to_openai_strict(schema: Any) -> tuple[dict[str, Any], bool, str | None]:
    """(wire schema, strict, reason when not strict)."""
    base = normalize(schema)
    try:
        return _strictify(base), True, None
    except NotStrict as exc:
        return to_openai(schema), False, str(exc)


def _strictify(root: dict[str, Any]) -> dict[str, Any]:
    stats = {"props": 0, "enum": 0}
    defs_src: dict[str, Any] = {}
    for key in ("$defs", "definitions"):
        if isinstance(root.get(key), dict):
            for k, v in root[key].items():
                defs_src[f"#/{key}/{_esc(k)}"] = v

    def conv(node: Any, depth: int, is_root: bool = False) -> dict[str, Any]:
        if node is True or node == {}:
            raise NotStrict("an untyped value")
        if not isinstance(node, dict):
            raise NotStrict("a false schema")
        if depth > STRICT_MAX_DEPTH:
            raise NotStrict(f"nesting deeper than {STRICT_MAX_DEPTH}")
        if "$ref" in node:
            ref = node["$ref"]
            if ref == "#" or ref in defs_src:
                return {"$ref": _strict_ref(ref)}
            raise NotStrict(f"unsupported $ref {ref}")
        for bad in ("not", "if", "then", "else", "patternProperties", "propertyNames", "unevaluatedProperties",
                    "dependentSchemas", "prefixItems", "contains"):
            if bad in node:
                raise NotStrict(f"keyword {bad}")
        out: dict[str, Any] = {k: v for k, v in node.items()
                               if k in ("description", "title", "pattern", "minimum", "maximum", "exclusiveMinimum",
                                        "exclusiveMaximum", "multipleOf", "minItems", "maxItems")}
        if node.get("format") in STRICT_FORMATS:
            out["format"] = node["format"]
        if "enum" in node:
            out["enum"] = list(node["enum"])
            stats["enum"] += len(out["enum"])
        if "const" in node:
            out["const"] = node["const"]
        branches = node.get("anyOf") or node.get("oneOf")
        if "allOf" in node:
            merged = _merge_branches({k: v for k, v in node.items() if k != "allOf"},
                                     [deref(root, b) for b in node["allOf"]], all_of=True)
            if not all(isinstance(deref(root, b), dict) and types_of(deref(root, b)) in (None, ["object"])
                       for b in node["allOf"]):
                raise NotStrict("allOf of non-objects")
            merged.setdefault("type", "object")
            return conv(merged, depth, is_root)
        if branches:
            if is_root:
                raise NotStrict("a combinator at the root")
            out["anyOf"] = [conv(b, depth + 1) for b in branches]
            return out
        t = types_of(node)
        if t is None:
            if "enum" in node or "const" in node:
                return out
            if "properties" in node:
                t = ["object"]
            else:
                raise NotStrict("an untyped value")
        out["type"] = t[0] if len(t) == 1 else list(t)
        if "object" in t:
            ap = node.get("additionalProperties")
            props = node.get("properties")
            if ap not in (None, False) or (not props and ap is not False and not is_root):
                raise NotStrict("an open object")
            props = props or {}
            stats["props"] += len(props)
            required = set(node.get("required") or [])
            out["properties"] = {}
            for k, v in props.items():
                sub = conv(v, depth + 1)
                out["properties"][k] = sub if k in required else _nullable(sub)
            out["required"] = list(props)
            out["additionalProperties"] = False
        if "array" in t:
            if not isinstance(node.get("items"), (dict, bool)):
                raise NotStrict("an array without items")
            out["items"] = conv(node["items"], depth + 1)
        return out

    out = conv(root, 0, is_root=True)
    if defs_src:
        out["$defs"] = {}
        for ref, sub in defs_src.items():
            out["$defs"][_unesc(_strict_ref(ref)[len("#/$defs/"):])] = conv(sub, 1)
    if stats["props"] > STRICT_MAX_PROPERTIES:
        raise NotStrict(f"more than {STRICT_MAX_PROPERTIES} properties")
    if stats["enum"] > STRICT_MAX_ENUM_VALUES:
        raise NotStrict(f"more than {STRICT_MAX_ENUM_VALUES} enum values")
    return out


def _strict_ref(ref: str) -> str:
    if ref.startswith("#/definitions/"):
        return "#/$defs/definitions__" + ref[len("#/definitions/"):]
    return ref


def _nullable(sub: dict[str, Any]) -> dict[str, Any]:
    if "$ref" in sub or "anyOf" in sub or "type" not in sub or "const" in sub:
        if "anyOf" in sub and "$ref" not in sub:
            if not any(b.get("type") == "null" for b in sub["anyOf"]):
                return {**sub, "anyOf": [*sub["anyOf"], {"type": "null"}]}
            return sub
        return {"anyOf": [sub, {"type": "null"}]}
    t = sub["type"]
    ts = [t] if isinstance(t, str) else list(t)
    if "null" in ts:
        return sub
    out = {**sub, "type": [*ts, "null"]}
    if "enum" in out and None not in out["enum"]:
        out["enum"] = [*out["enum"], None]
    return out


def to_gemini(schema: Any) -> dict[str, Any] | None:
    """The Gemini wire schema, or None for a tool without parameters."""
    root = normalize(schema)

    def conv(node: Any, stack: tuple[str, ...] = ()) -> dict[str, Any]:
        if node is True or node is None or (isinstance(node, dict) and not node):
            return {"type": "string", "description": JSON_VALUE_NOTE}
        if node is False or not isinstance(node, dict):
            return {"type": "string", "description": JSON_VALUE_NOTE}
        if isinstance(node.get("$ref"), str):
            ref = node["$ref"]
            if ref in stack or len(stack) > 12:
                return _json_string(node, JSON_VALUE_NOTE)
            target = resolve_pointer(root, ref)
            merged = {**(target if isinstance(target, dict) else {}),
                      **{k: v for k, v in node.items() if k != "$ref" and k in ANNOTATIONS}}
            return conv(merged, (*stack, ref))
        desc_extra: list[str] = []
        if "allOf" in node:
            node = _merge_branches({k: v for k, v in node.items() if k != "allOf"},
                                   [deref(root, b) for b in node["allOf"]], all_of=True)
            node.setdefault("type", "object")
        branches = node.get("anyOf") or node.get("oneOf")
        if branches:
            nulls = [b for b in branches if isinstance(b, dict) and types_of(b) == ["null"]]
            rest = [b for b in branches if b not in nulls]
            base = {k: v for k, v in node.items() if k not in ("anyOf", "oneOf")}
            if len(rest) == 1:
                inner = deref(root, rest[0]) if isinstance(rest[0], dict) else rest[0]
                merged = {**(inner if isinstance(inner, dict) else {}),
                          **{k: v for k, v in base.items() if k in ANNOTATIONS}}
                out = conv(merged, stack)
            else:
                out = dict(_annotations(base))
                out["anyOf"] = [conv(b, stack) for b in rest]
            if nulls:
                out["nullable"] = True
            return out
        t = types_of(node)
        nullable = bool(t and "null" in t)
        t = [x for x in (t or []) if x != "null"]
        if not t:
            if "enum" in node or "const" in node:
                vals = node.get("enum", [node.get("const")])
                t = sorted({_json_type(v) for v in vals if v is not None}) or ["string"]
            elif "properties" in node:
                t = ["object"]
            elif "items" in node:
                t = ["array"]
            else:
                return _json_string(node, JSON_VALUE_NOTE, nullable)
        if len(t) > 1:
            out = _annotations(node)
            rest_node = {k: v for k, v in node.items()
                         if k not in ("type", "title", "description", "examples", "example")}
            out["anyOf"] = [conv({**rest_node, "type": x}, stack) for x in t]
            if nullable:
                out["nullable"] = True
            return out
        kind = t[0]
        out = _annotations(node)
        out["type"] = kind
        if nullable:
            out["nullable"] = True
        vals = node.get("enum") if "enum" in node else ([node["const"]] if "const" in node else None)
        if vals is not None:
            if None in vals:
                out["nullable"] = True
            vals = [v for v in vals if v is not None]
            if kind == "string" and all(isinstance(v, str) for v in vals) and vals:
                out["enum"] = vals
            elif vals:
                desc_extra.append("allowed values: " + ", ".join(json.dumps(v, ensure_ascii=False) for v in vals))
        fmt = node.get("format")
        if isinstance(fmt, str):
            if fmt in GEMINI_FORMATS.get(kind, ()):
                out["format"] = fmt
            else:
                desc_extra.append(f"format: {fmt}")
        for k in ("minLength", "maxLength", "pattern", "minItems", "maxItems", "minProperties", "maxProperties"):
            v = node.get(k)
            if isinstance(v, (int, str)) and not isinstance(v, bool) and (k == "pattern") == isinstance(v, str):
                out[k] = v
        for k, alt in (("minimum", "exclusiveMinimum"), ("maximum", "exclusiveMaximum")):
            v = node.get(k, node.get(alt))
            if isinstance(v, (int, float)) and not isinstance(v, bool):
                out[k] = v
        if kind == "object":
            props = node.get("properties") or {}
            if not props:
                return _json_string(node, JSON_OBJECT_NOTE, out.get("nullable", False), desc_extra)
            out["properties"] = {k: conv(v, stack) for k, v in props.items()}
            req = [k for k in (node.get("required") or []) if k in props]
            if req:
                out["required"] = req
        elif kind == "array":
            items = node.get("items")
            if not isinstance(items, (dict, bool)):
                return _json_string(node, JSON_ARRAY_NOTE, out.get("nullable", False), desc_extra)
            out["items"] = conv(items, stack)
        if desc_extra:
            out["description"] = _join_desc(out.get("description"), desc_extra)
        return out

    wire = conv(root)
    if wire.get("type") != "object" or not wire.get("properties"):
        return None
    return wire


def _annotations(node: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k in ("title", "description"):
        if isinstance(node.get(k), str):
            out[k] = node[k]
    ex = node.get("examples")
    if isinstance(ex, list) and ex:
        out["example"] = ex[0]
    elif "example" in node:
        out["example"] = node["example"]
    return out


def _json_string(node: dict[str, Any], note: str, nullable: bool = False,
                 extra: list[str] | None = None) -> dict[str, Any]:
    out: dict[str, Any] = {"type": "string"}
    if isinstance(node.get("title"), str):
        out["title"] = node["title"]
    out["description"] = _join_desc(node.get("description") if isinstance(node.get("description"), str) else None,
                                    [*(extra or []), note])
    if nullable:
        out["nullable"] = True
    return out


def _join_desc(desc: str | None, extra: list[str]) -> str:
    tail = "(" + "; ".join(extra) + ")"
    return f"{desc} {tail}" if desc else tail


def _json_type(v: Any) -> str:
    if isinstance(v, bool):
        return "boolean"
    if isinstance(v, int):
        return "integer"
    if isinstance(v, float):
        return "number"
    if isinstance(v, str):
        return "string"
    if isinstance(v, list):
        return "array"
    return "object"


def gemini_as_jsonschema(node: Any) -> Any:
    """A Gemini wire schema read as JSON Schema 2020-12 (``nullable`` → a null branch; ``example``, ``format``
    and ``propertyOrdering`` are annotations), to validate examples the way the API reads the schema."""
    if not isinstance(node, dict):
        return node
    out: dict[str, Any] = {}
    for k, v in node.items():
        if k in ("nullable", "example", "format", "propertyOrdering"):
            continue
        if k == "properties":
            out[k] = {pk: gemini_as_jsonschema(pv) for pk, pv in v.items()}
        elif k == "items":
            out[k] = gemini_as_jsonschema(v)
        elif k == "anyOf":
            out[k] = [gemini_as_jsonschema(b) for b in v]
        else:
            out[k] = v
    if node.get("nullable"):
        if isinstance(out.get("type"), str):
            out["type"] = [out["type"], "null"]
            if "enum" in out:
                out["enum"] = [*out["enum"], None]
        else:
            out = {"anyOf": [out, {"type": "null"}]}
    return out


# ---------------------------------------------------------------- examples and defaults
@dataclass
class WireReport:
    strict: bool | None = None
    not_strict_reason: str | None = None
    examples_kept: int = 0
    examples_dropped: int = 0
    defaults_dropped: int = 0


def _validator(root: Any, pointer: str) -> Draft202012Validator:
    registry: Registry = Registry().with_resource("urn:ctx:wire", Resource.from_contents(root, DRAFT202012))
    return Draft202012Validator({"$ref": f"urn:ctx:wire#{pointer}"}, registry=registry)


def is_valid(root: Any, value: Any, pointer: str = "") -> bool:
    try:
        return _validator(root, pointer).is_valid(value)
    except Exception:  # noqa: BLE001 - a schema the validator cannot even read accepts nothing
        return False


def _clean_annotations(wire: dict[str, Any], dialect: Dialect, report: WireReport) -> dict[str, Any]:
    """Validate schema-level ``examples``/``example``/``default`` against the final wire schema; drop failures."""
    check_root = gemini_as_jsonschema_tree(wire) if dialect == "gemini" else wire
    todo: list[tuple[str, dict[str, Any]]] = list(walk(wire))
    for pointer, node in todo:
        node_check = pointer
        if "examples" in node:
            ex = node["examples"]
            kept = [e for e in ex if is_valid(check_root, e, node_check)] if isinstance(ex, list) else []
            report.examples_dropped += (len(ex) if isinstance(ex, list) else 1) - len(kept)
            report.examples_kept += len(kept)
            if kept:
                node["examples"] = kept
            else:
                node.pop("examples")
        if "example" in node:
            if is_valid(check_root, node["example"], node_check):
                report.examples_kept += 1
            else:
                node.pop("example")
                report.examples_dropped += 1
        if "default" in node and not is_valid(check_root, node["default"], node_check):
            node.pop("default")
            report.defaults_dropped += 1
    return wire


def gemini_as_jsonschema_tree(wire: dict[str, Any]) -> dict[str, Any]:
    """Like :func:`gemini_as_jsonschema` but keeping every node at its pointer (``nullable`` as a type list, or
    ``type: null`` added to an anyOf), so pointers into the wire schema stay valid."""
    def conv(node: Any) -> Any:
        if not isinstance(node, dict):
            return node
        out = {k: v for k, v in node.items() if k not in ("nullable", "example", "format", "propertyOrdering")}
        if "properties" in out:
            out["properties"] = {k: conv(v) for k, v in out["properties"].items()}
        if "items" in out:
            out["items"] = conv(out["items"])
        if "anyOf" in out:
            out["anyOf"] = [conv(b) for b in out["anyOf"]]
        if node.get("nullable"):
            if isinstance(out.get("type"), str):
                out["type"] = [out["type"], "null"]
                if "enum" in out:
                    out["enum"] = [*out["enum"], None]
            elif "anyOf" in out:
                out["anyOf"] = [*out["anyOf"], {"type": "null"}]
        return out

    return conv(wire)


def _strip_keys(wire: dict[str, Any], keys: tuple[str, ...]) -> dict[str, Any]:
    def fn(node: dict[str, Any]) -> dict[str, Any]:
        for k in keys:
            node.pop(k, None)
        return node

    return map_schema(wire, fn)


# ---------------------------------------------------------------- tools
def wire_schema(schema: Any, dialect: Dialect) -> tuple[dict[str, Any] | None, WireReport]:
    """The final wire schema of one tool input schema for ``dialect`` (examples/defaults validated)."""
    report = WireReport()
    if dialect == "anthropic":
        wire: dict[str, Any] | None = to_anthropic(schema)
    elif dialect == "openai":
        wire = to_openai(schema)
    elif dialect == "openai-strict":
        wire, strict, reason = to_openai_strict(schema)
        report.strict, report.not_strict_reason = strict, reason
        if strict:
            # unsupported keywords were never copied; nothing to validate but the structure itself
            return wire, report
    elif dialect == "gemini":
        wire = to_gemini(schema)
        if wire is None:
            return None, report
        wire = _strip_keys(wire, ("default",))
    else:
        raise ValueError(f"unknown dialect {dialect!r}")
    assert wire is not None
    return _clean_annotations(wire, dialect, report), report


def wire_tool(name: str, description: str, schema: Any, dialect: Dialect,
              input_examples: list[Any] | None = None) -> tuple[dict[str, Any], WireReport]:
    """One tool as it goes on the wire: ``{name, description, inputSchema, inputExamples?, strict?}``.

    Tool-level examples are an Anthropic field (``input_examples``); each is kept only if it is valid against the
    final wire schema AND the original one (an example the server would reject teaches the model nothing good).
    Other dialects have no such field: the examples are not sent."""
    wire, report = cached_wire_schema(_freeze(schema), dialect)
    out: dict[str, Any] = {"name": name, "description": description, "inputSchema": wire}
    if dialect == "openai-strict":
        out["strict"] = bool(report.strict)
    if input_examples:
        if dialect == "anthropic":
            original = normalize(schema)
            kept = [e for e in input_examples if is_valid(wire, e) and is_valid(original, e)]
            report = WireReport(**report.__dict__)
            report.examples_kept += len(kept)
            report.examples_dropped += len(input_examples) - len(kept)
            if kept:
                out["inputExamples"] = kept
        else:
            report = WireReport(**report.__dict__)
            report.examples_dropped += len(input_examples)
    return out, report


def _freeze(schema: Any) -> str:
    # key order is kept: property order is meaningful to models, and the output is a pure function of the input
    return json.dumps(schema, separators=(",", ":"), ensure_ascii=False)


@lru_cache(maxsize=4096)
def _cached(frozen: str, dialect: Dialect) -> tuple[str, WireReport]:
    wire, report = wire_schema(json.loads(frozen), dialect)
    return json.dumps(wire, ensure_ascii=False), report


def cached_wire_schema(frozen: str, dialect: Dialect) -> tuple[dict[str, Any] | None, WireReport]:
    text, report = _cached(frozen, dialect)
    return json.loads(text), report


# ---------------------------------------------------------------- checks (tests, bench)
def check_wire(schema: Any, dialect: Dialect, strict: bool | None = None) -> list[str]:
    """Problems that would make the provider reject this wire schema (empty = valid)."""
    problems: list[str] = []
    if dialect == "gemini":
        if schema is None:
            return []
        errors = sorted(GEMINI_META.iter_errors(schema), key=lambda e: list(e.absolute_path))
        problems += [f"gemini subset: /{'/'.join(map(str, e.absolute_path))}: {e.message[:160]}" for e in errors]
        for pointer, node in walk(schema):
            if node.get("type") == "object" and not node.get("properties"):
                problems.append(f"{pointer or '/'}: OBJECT without properties")
            if node.get("type") == "array" and "items" not in node:
                problems.append(f"{pointer or '/'}: ARRAY without items")
            req = node.get("required")
            if req and not set(req) <= set(node.get("properties") or {}):
                problems.append(f"{pointer or '/'}: required names a missing property")
        return problems
    if not isinstance(schema, dict):
        return ["schema is not an object"]
    try:
        Draft202012Validator.check_schema(schema)
    except Exception as exc:  # noqa: BLE001
        problems.append(f"not a valid draft 2020-12 schema: {str(exc).splitlines()[0][:200]}")
    if schema.get("type") != "object":
        problems.append("root type is not object")
    for key in ("anyOf", "oneOf", "allOf"):
        if key in schema:
            problems.append(f"root has {key}")
    if "$schema" in schema and "2020-12" not in str(schema["$schema"]):
        problems.append(f"claims {schema['$schema']}")
    for pointer, node in walk(schema):
        ref = node.get("$ref")
        if isinstance(ref, str) and resolve_pointer(schema, ref) is None:
            problems.append(f"{pointer}: dangling $ref {ref}")
    if dialect in ("openai", "openai-strict"):
        for pointer, node in walk(schema):
            t = types_of(node)
            if t and "array" in t and "items" not in node and "prefixItems" not in node:
                problems.append(f"{pointer}: array schema missing items")
    if dialect == "openai-strict" and strict:
        problems += _check_strict(schema)
    return problems


def _check_strict(schema: dict[str, Any]) -> list[str]:
    problems = []
    for pointer, node in walk(schema):
        extra = set(node) - STRICT_KEYWORDS
        if extra:
            problems.append(f"{pointer}: unsupported keywords {sorted(extra)}")
        t = types_of(node)
        if t and "object" in t:
            if node.get("additionalProperties") is not False:
                problems.append(f"{pointer}: object not closed")
            if set(node.get("required") or []) != set(node.get("properties") or {}):
                problems.append(f"{pointer}: not every property is required")
        if node.get("format") is not None and node["format"] not in STRICT_FORMATS:
            problems.append(f"{pointer}: format {node['format']}")
    if "anyOf" in schema:
        problems.append("root anyOf")
    return problems


_GEMINI_META_DOC: dict[str, Any] = {
    "$schema": "https://json-schema.org/draft/2020-12/schema",
    "$ref": "#/$defs/schema",
    "$defs": {
        "schema": {
            "type": "object",
            "additionalProperties": False,
            "properties": {
                "type": {"enum": list(GEMINI_TYPES)},
                "format": {"type": "string"},
                "title": {"type": "string"},
                "description": {"type": "string"},
                "nullable": {"type": "boolean"},
                "enum": {"type": "array", "items": {"type": "string"}, "minItems": 1},
                "maxItems": {"type": "integer", "minimum": 0},
                "minItems": {"type": "integer", "minimum": 0},
                "properties": {"type": "object", "additionalProperties": {"$ref": "#/$defs/schema"}},
                "required": {"type": "array", "items": {"type": "string"}},
                "minProperties": {"type": "integer", "minimum": 0},
                "maxProperties": {"type": "integer", "minimum": 0},
                "minLength": {"type": "integer", "minimum": 0},
                "maxLength": {"type": "integer", "minimum": 0},
                "pattern": {"type": "string"},
                "example": True,
                "anyOf": {"type": "array", "items": {"$ref": "#/$defs/schema"}, "minItems": 1},
                "items": {"$ref": "#/$defs/schema"},
                "minimum": {"type": "number"},
                "maximum": {"type": "number"},
                "propertyOrdering": {"type": "array", "items": {"type": "string"}},
            },
            "anyOf": [{"required": ["type"]}, {"required": ["anyOf"]}],
            "allOf": [
                {"if": {"properties": {"type": {"const": "string"}}, "required": ["type"]},
                 "then": {"properties": {"format": {"enum": sorted(GEMINI_FORMATS["string"])}}}},
                {"if": {"properties": {"type": {"const": "integer"}}, "required": ["type"]},
                 "then": {"properties": {"format": {"enum": sorted(GEMINI_FORMATS["integer"])}}}},
                {"if": {"properties": {"type": {"const": "number"}}, "required": ["type"]},
                 "then": {"properties": {"format": {"enum": sorted(GEMINI_FORMATS["number"])}}}},
                {"if": {"required": ["enum"]}, "then": {"properties": {"type": {"const": "string"}}}},
            ],
        }
    },
}
GEMINI_META = Draft202012Validator(_GEMINI_META_DOC)


def check_examples(tool: Mapping[str, Any], dialect: Dialect) -> int:
    """How many examples in a wire tool are NOT valid against its wire schema (must be 0)."""
    schema = tool.get("inputSchema")
    root = gemini_as_jsonschema_tree(schema) if dialect == "gemini" and schema else schema
    bad = 0
    for ex in tool.get("inputExamples") or []:
        if root is None or not is_valid(root, ex):
            bad += 1
    for pointer, node in walk(schema or {}):
        for ex in node.get("examples") or [] if isinstance(node.get("examples"), list) else []:
            bad += not is_valid(root, ex, pointer)
        if "example" in node:
            bad += not is_valid(root, node["example"], pointer)
        if "default" in node:
            bad += not is_valid(root, node["default"], pointer)
    return bad


def claimed_draft_valid(schema: Any) -> bool:
    """Is the ORIGINAL schema valid against the metaschema of the draft it claims (07 or 2020-12)?"""
    if not isinstance(schema, dict):
        return False
    cls = Draft7Validator if "draft-07" in str(schema.get("$schema", "")) else Draft202012Validator
    try:
        cls.check_schema(schema)
        return True
    except Exception:  # noqa: BLE001
        return False


def count_open_objects(schema: Any) -> int:
    """Explicitly open objects: ``additionalProperties: true`` or ``{}``."""
    return sum(1 for _, node in walk(schema) if node.get("additionalProperties") is True
               or node.get("additionalProperties") == {})


def count_json_strings(schema: Any) -> int:
    """Gemini: values sent as JSON-encoded strings (open objects, typed maps, untyped values)."""
    notes = (JSON_OBJECT_NOTE, JSON_ARRAY_NOTE, JSON_VALUE_NOTE)
    return sum(1 for _, node in walk(schema) if node.get("type") == "string"
               and any(n in str(node.get("description", "")) for n in notes))


# ---------------------------------------------------------------- arguments back from the model
def coerce_arguments(schema: Any, args: Any) -> Any:
    """Undo what a wire dialect made the model send, judged against the ORIGINAL schema only:
    a JSON string where the schema accepts no string but an object/array → decoded (Gemini); a ``null`` for an
    optional property whose schema does not accept null → the property omitted (OpenAI strict). Everything
    else is left as it is (the server validates)."""
    root = normalize(schema) if isinstance(schema, dict) else {}
    return _coerce(root, root, copy.deepcopy(args), 0)


def _coerce(root: Any, node: Any, value: Any, depth: int) -> Any:
    if depth > 32:
        return value
    node = deref(root, node)
    if not isinstance(node, dict):
        return value
    if isinstance(value, str) and not _accepts(root, node, "string") and (
            _accepts(root, node, "object") or _accepts(root, node, "array")):
        try:
            parsed = json.loads(value)
        except ValueError:
            parsed = None
        if (isinstance(parsed, dict) and _accepts(root, node, "object")) or \
                (isinstance(parsed, list) and _accepts(root, node, "array")):
            value = parsed
    if isinstance(value, dict):
        props, required = _object_view(root, node)
        for k in list(value):
            sub = props.get(k)
            if sub is None:
                continue
            if value[k] is None and k not in required and not _accepts(root, sub, "null"):
                del value[k]
                continue
            value[k] = _coerce(root, sub, value[k], depth + 1)
    elif isinstance(value, list):
        items = node.get("items")
        if isinstance(items, dict):
            value = [_coerce(root, items, v, depth + 1) for v in value]
    return value


def _object_view(root: Any, node: dict[str, Any]) -> tuple[dict[str, Any], set[str]]:
    props: dict[str, Any] = dict(node.get("properties") or {})
    required = set(node.get("required") or [])
    for b in node.get("allOf") or []:
        b = deref(root, b)
        if isinstance(b, dict):
            for k, v in (b.get("properties") or {}).items():
                props.setdefault(k, v)
            required |= set(b.get("required") or [])
    return props, required


def _accepts(root: Any, node: Any, kind: str, depth: int = 0) -> bool:
    """Might ``node`` accept a value of JSON type ``kind``? (permissive: unknown → True)."""
    node = deref(root, node)
    if node is True or node == {} or depth > 16:
        return True
    if not isinstance(node, dict):
        return False
    branches = (node.get("anyOf") or []) + (node.get("oneOf") or [])
    if branches and not any(_accepts(root, b, kind, depth + 1) for b in branches):
        return False
    for b in node.get("allOf") or []:
        if not _accepts(root, b, kind, depth + 1):
            return False
    if "const" in node:
        return _json_type(node["const"]) == kind or (kind == "number" and _json_type(node["const"]) == "integer") \
            or (kind == "null" and node["const"] is None)
    if "enum" in node and isinstance(node["enum"], list):
        return any((v is None and kind == "null") or (v is not None and _json_type(v) == kind)
                   for v in node["enum"])
    t = types_of(node)
    if t is None:
        return True
    return kind in t or (kind == "integer" and "number" in t)


def finite_window(window: Any) -> float | None:
    """A context window counts only if finite and > 0 (SPEC §2.2)."""
    if isinstance(window, bool) or not isinstance(window, (int, float)):
        return None
    if not math.isfinite(window) or window <= 0:
        return None
    return float(window)


__all__ = ["DIALECTS", "Dialect", "WireReport", "check_examples", "check_wire", "claimed_draft_valid",
           "coerce_arguments", "count_json_strings", "count_open_objects", "gemini_as_jsonschema",
           "normalize", "to_anthropic", "to_gemini", "to_openai", "to_openai_strict", "wire_schema", "wire_tool"]
