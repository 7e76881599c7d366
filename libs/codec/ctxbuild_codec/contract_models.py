"""The generated pydantic model of a subject's request or reply, or of an event, by name.

The models live in :mod:`ctxbuild_codec.models` (generated from contracts/ by ``libs/codec/codegen.py``; one module per
schema; ``models/index.py`` names each schema's own model). JSON Schema stays the contract: ``@rpc`` validates against
it first, so a model only ever parses what the schema accepted.
"""

from __future__ import annotations

import importlib
from functools import cache
from typing import Any, TypeVar

from pydantic import BaseModel

from .models.index import MODELS

M = TypeVar("M", bound=BaseModel)


@cache
def schema_model(schema: str) -> type[BaseModel]:
    """The model of ``contracts/<schema>`` (e.g. ``model/offload.json``); KeyError when there is no such schema."""
    module, name = MODELS[schema]
    return getattr(importlib.import_module(f"ctxbuild_codec.models.{module}"), name)


def subject_model(subject: str, kind: str) -> type[BaseModel]:
    """``subject_model("ctx.blob.put", "request")`` → ``CtxBlobPutRequest``."""
    if kind not in ("request", "reply"):
        raise ValueError(f"kind must be request or reply, not {kind!r}")
    return schema_model(f"subjects/{subject}.{kind}.json")


def event_model(event_type: str) -> type[BaseModel] | None:
    """The model of ``contracts/events/<event_type>.json``, or None for an event type without a contract."""
    name = f"events/{event_type}.json"
    return schema_model(name) if name in MODELS else None


def dump(model: BaseModel) -> dict[str, Any]:
    """A model as the JSON-ready dict it came from: fields never set stay absent (the contracts tell an absent field
    from a null one), aliases as on the wire."""
    return model.model_dump(mode="json", by_alias=True, exclude_unset=True)


def parse(model: type[M], data: Any) -> M:
    """``data`` (already valid against the schema) as ``model``."""
    return model.model_validate(data)
