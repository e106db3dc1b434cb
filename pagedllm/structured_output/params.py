"""What a request's output must match (vLLM's ``StructuredOutputsParams``): exactly one of a JSON
schema, any JSON object, a regex, a choice of strings, or a grammar (Lark or GBNF/EBNF)."""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Optional, Union

_KINDS = ("json", "json_object", "regex", "choice", "grammar")


@dataclass
class StructuredOutputsParams:
    """Attributes:
        json: a JSON schema (dict, or its JSON text) the output must validate against.
        json_object: True for "any JSON object" (OpenAI ``response_format={"type": "json_object"}``).
        regex: a regular expression (Rust ``regex`` syntax) the whole output must match.
        choice: the output is exactly one of these strings.
        grammar: a Lark grammar, or a GBNF/EBNF one (llama.cpp syntax), the output must derive.
        disable_any_whitespace: JSON without whitespace between tokens (compact output).
        whitespace_pattern: regex of the whitespace allowed between JSON tokens (default: up to
            16 blanks).
        disable_additional_properties: what a schema's objects that do not say
            ``additionalProperties`` do with keys they do not declare. None (the default) or True:
            refused, as vLLM's default backend (xgrammar's strict mode) and its guidance backend with
            ``disable_additional_properties`` do; False: allowed, as vLLM's guidance backend does by
            default (JSON Schema's own rule). A schema that says ``additionalProperties`` is kept.

    Raises:
        ValueError: when not exactly one of the constraints is set, or one has the wrong type.
    """

    json: Optional[Union[str, dict]] = None
    json_object: Optional[bool] = None
    regex: Optional[str] = None
    choice: Optional[list[str]] = None
    grammar: Optional[str] = None
    disable_any_whitespace: bool = False
    whitespace_pattern: Optional[str] = None
    disable_additional_properties: Optional[bool] = None

    def __post_init__(self) -> None:
        set_ = [k for k in _KINDS if getattr(self, k) not in (None, False)]
        if len(set_) != 1:
            raise ValueError(f"structured_outputs needs exactly one of {', '.join(_KINDS)}, got "
                             f"{', '.join(set_) or 'none'}")
        if isinstance(self.json, str):
            try:
                self.json = json.loads(self.json)
            except ValueError as e:
                raise ValueError(f"structured_outputs json is not valid JSON: {e}") from None
        if self.json is not None and not isinstance(self.json, (dict, bool)):
            raise ValueError("structured_outputs json must be a JSON schema object")
        if self.regex is not None and not isinstance(self.regex, str):
            raise ValueError("structured_outputs regex must be a string")
        if self.grammar is not None and not isinstance(self.grammar, str):
            raise ValueError("structured_outputs grammar must be a string")
        if self.choice is not None:
            if not isinstance(self.choice, list) or not self.choice or \
                    not all(isinstance(c, str) for c in self.choice):
                raise ValueError("structured_outputs choice must be a non-empty list of strings")

    @property
    def kind(self) -> str:
        return next(k for k in _KINDS if getattr(self, k) not in (None, False))

    def key(self) -> tuple:
        """Hashable identity of the constraint (the grammar cache key)."""
        value: Any = getattr(self, self.kind)
        return (self.kind, json.dumps(value, sort_keys=True), self.disable_any_whitespace, self.whitespace_pattern,
                self.disable_additional_properties is not False)

    def effective_json_schema(self) -> Any:
        """The JSON schema the grammar is built from: ``json`` with undeclared properties refused
        unless ``disable_additional_properties`` is False (see the class)."""
        if self.disable_additional_properties is False:
            return self.json
        return without_additional_properties(self.json)


# Keywords whose value is a schema, a list of schemas, or a map of name -> schema (JSON Schema 2020-12).
_ONE = ("additionalProperties", "items", "contains", "not", "if", "then", "else", "propertyNames",
        "unevaluatedProperties", "unevaluatedItems", "additionalItems")
_LIST = ("anyOf", "oneOf", "allOf", "prefixItems")
_MAP = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")


def without_additional_properties(schema: Any) -> Any:
    """A copy of ``schema`` in which every object schema that declares ``properties`` or
    ``patternProperties`` and does not say ``additionalProperties`` gets ``additionalProperties:
    false`` (vLLM's ``process_for_additional_properties`` for its guidance backend, walking only
    the keywords that hold schemas, so a property named "properties" is left alone). An object
    schema without declared properties (``{"type": "object"}``) still takes any keys."""
    if isinstance(schema, list):  # (items as a list, draft 4-7)
        return [without_additional_properties(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for k in _ONE:
        if isinstance(out.get(k), (dict, list)):
            out[k] = without_additional_properties(out[k])
    for k in _LIST:
        if isinstance(out.get(k), list):
            out[k] = [without_additional_properties(s) for s in out[k]]
    for k in _MAP:
        if isinstance(out.get(k), dict):
            out[k] = {name: without_additional_properties(s) for name, s in out[k].items()}
    if ("properties" in out or "patternProperties" in out) and "additionalProperties" not in out \
            and "unevaluatedProperties" not in out:
        out["additionalProperties"] = False
    return out
