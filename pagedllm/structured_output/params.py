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
        return self.kind, json.dumps(value, sort_keys=True), self.disable_any_whitespace, self.whitespace_pattern
