"""The base of every model generated from contracts/ (``libs/codec/codegen.py --base-class``)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class ContractModel(BaseModel):
    """An object schema without ``additionalProperties: false`` is open (JSON Schema's default): its model keeps the
    members it does not name, so parse → dump gives back what the schema accepted. A closed schema's model sets
    ``extra="forbid"`` itself, which overrides this."""

    model_config = ConfigDict(extra="allow")
