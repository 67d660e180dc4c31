"""A request's tools and ``tool_choice``: validation, and the JSON schemas that force a call.

Tools come in the chat API's shape ``{"type": "function", "function": {"name", "description"?, "parameters"?,
"strict"?}}`` or the Responses API's flat one ``{"type": "function", "name", ...}`` (``flat``). A name is 1-64
letters, digits, ``_``, ``-`` or ``.``, unique in the request; ``parameters`` is a JSON schema of an object
(absent: no arguments). Errors are :class:`ToolError` with the message and the field (``tools[2].function.name``).

``tool_choice``: ``"none"``, ``"auto"``, ``"required"``, or a function by name (chat: ``{"type": "function",
"function": {"name"}}``; Responses: ``{"type": "function", "name"}``). The forced choices become structured
output (as vLLM does):

- ``required``: ``{"type": "array", "minItems": 1, "items": {"anyOf": [{"type": "object", "properties":
  {"name": {"enum": [tool name]}, "parameters": <its parameters>}, "required": ["name", "parameters"]}, ...]}}``
  (``"maxItems": 1`` when ``parallel_tool_calls`` is false); the tools' ``$defs`` move to the root, where
  their ``#/$defs/...`` references find them (two tools defining one name differently is a 400).
- a named function: that function's ``parameters``.
"""

from __future__ import annotations

import copy
import re
from dataclasses import dataclass
from typing import Any

TOOL_NAME = re.compile(r"[A-Za-z0-9_.\-]{1,64}")
MAX_TOOLS = 128
NO_ARGUMENTS = {"type": "object", "properties": {}, "additionalProperties": False}


class ToolError(ValueError):
    """A bad ``tools`` / ``tool_choice`` / tool history field: 400 naming ``param``."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class Tool:
    name: str
    description: str | None
    parameters: dict | None
    strict: bool | None = None

    def chat(self) -> dict:
        """The tool in the chat API's shape (what chat templates take)."""
        function: dict[str, Any] = {"name": self.name}
        if self.description is not None:
            function["description"] = self.description
        if self.parameters is not None:
            function["parameters"] = self.parameters
        return {"type": "function", "function": function}

    def responses(self) -> dict:
        """The tool as the Responses API echoes it."""
        return {"type": "function", "name": self.name, "description": self.description,
                "parameters": self.parameters, "strict": self.strict}


def validate_tools(tools: Any, flat: bool = False) -> list[Tool]:
    """The request's tools, checked (``flat``: the Responses API's shape)."""
    if not isinstance(tools, list):
        raise ToolError(f"tools must be a list of function tools, got {type(tools).__name__}", "tools")
    if len(tools) > MAX_TOOLS:
        raise ToolError(f"tools holds {len(tools)} tools; at most {MAX_TOOLS} are accepted", "tools")
    out, seen = [], set()
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(tool, dict):
            raise ToolError(f"{where} must be an object, got {type(tool).__name__}", where)
        if tool.get("type", "function") != "function":
            raise ToolError(f"{where}.type {tool.get('type')!r} is not supported: only function tools "
                            "({'type': 'function', ...}) are", f"{where}.type")
        if flat:
            function, fwhere = tool, where
        else:
            function, fwhere = tool.get("function"), f"{where}.function"
            if not isinstance(function, dict):
                raise ToolError(f"{fwhere} must be an object with the function's name and parameters", fwhere)
        name = function.get("name")
        if not isinstance(name, str) or not TOOL_NAME.fullmatch(name):
            raise ToolError(f"{fwhere}.name must be 1-64 letters, digits, '_', '-' or '.', got {name!r}",
                            f"{fwhere}.name")
        if name in seen:
            raise ToolError(f"{fwhere}.name {name!r} names two tools; tool names must be unique", f"{fwhere}.name")
        seen.add(name)
        description = function.get("description")
        if description is not None and not isinstance(description, str):
            raise ToolError(f"{fwhere}.description must be a string", f"{fwhere}.description")
        strict = function.get("strict")
        if strict is not None and not isinstance(strict, bool):
            raise ToolError(f"{fwhere}.strict must be a boolean", f"{fwhere}.strict")
        parameters = function.get("parameters")
        if parameters is not None:
            _check_parameters(parameters, f"{fwhere}.parameters")
        out.append(Tool(name, description, parameters, strict))
    return out


def _check_parameters(schema: Any, where: str) -> None:
    """A JSON schema of an object: its own keywords of the right types (xgrammar checks the rest when a
    forced call compiles it)."""
    if not isinstance(schema, dict):
        raise ToolError(f"{where} must be a JSON schema (an object), got {type(schema).__name__}", where)
    kind = schema.get("type", "object")
    if kind != "object":
        raise ToolError(f"{where} must be the JSON schema of an object (type 'object'), got type {kind!r}", where)
    for key, kinds, what in (("properties", dict, "an object of JSON schemas"),
                             ("$defs", dict, "an object of JSON schemas"),
                             ("required", list, "a list of property names")):
        value = schema.get(key)
        if value is not None and not isinstance(value, kinds):
            raise ToolError(f"{where}.{key} must be {what}", f"{where}.{key}")
    for key in ("properties", "$defs"):
        for name, sub in (schema.get(key) or {}).items():
            if not isinstance(sub, (dict, bool)):
                raise ToolError(f"{where}.{key}.{name} must be a JSON schema (an object)", f"{where}.{key}.{name}")
    if not all(isinstance(r, str) for r in schema.get("required") or ()):
        raise ToolError(f"{where}.required must be a list of property names", f"{where}.required")


def tool_choice_mode(tool_choice: Any, tools: list[Tool], flat: bool = False) -> tuple[str, str | None]:
    """``(mode, function)``: mode ``"none"``, ``"auto"``, ``"required"`` or ``"named"`` (``function`` its name).
    ``tool_choice`` unset is ``"auto"`` with tools, ``"none"`` without (OpenAI's and vLLM's defaults);
    ``"required"`` with no tools is ``"none"`` (OpenAI's)."""
    if tool_choice is None:
        return ("auto" if tools else "none"), None
    if tool_choice in ("none", "auto", "required"):
        if not tools and tool_choice != "none":
            if tool_choice == "required":
                return "none", None
            raise ToolError(f"tool_choice {tool_choice!r} needs tools: send the functions in tools", "tool_choice")
        return tool_choice, None
    named = ("{'type': 'function', 'name': NAME}" if flat else
             "{'type': 'function', 'function': {'name': NAME}}")
    if not isinstance(tool_choice, dict) or tool_choice.get("type") != "function":
        raise ToolError(f"tool_choice must be 'none', 'auto', 'required' or {named}; got {tool_choice!r}",
                        "tool_choice")
    holder = tool_choice if flat else tool_choice.get("function")
    name = holder.get("name") if isinstance(holder, dict) else None
    if not isinstance(name, str):
        raise ToolError(f"tool_choice must name the function: {named}", "tool_choice")
    if name not in {t.name for t in tools}:
        raise ToolError(f"tool_choice names the function {name!r}, which is not in tools "
                        f"({', '.join(t.name for t in tools) or 'none given'})", "tool_choice")
    return "named", name


def named_schema(tool: Tool) -> dict:
    """The constraint of ``tool_choice`` naming ``tool``: its arguments."""
    return copy.deepcopy(tool.parameters) if tool.parameters is not None else dict(NO_ARGUMENTS)


def required_schema(tools: list[Tool], parallel: bool = True) -> dict:
    """The constraint of ``tool_choice: "required"``: an array of one call or more (one: not ``parallel``)."""
    definitions: dict[str, Any] = {}
    variants = []
    for i, tool in enumerate(tools):
        parameters = copy.deepcopy(tool.parameters) if tool.parameters is not None else dict(NO_ARGUMENTS)
        for name, definition in (parameters.pop("$defs", None) or {}).items():
            if name in definitions and definitions[name] != definition:
                raise ToolError(f"tools define $defs.{name} twice, differently (tools[{i}]); a required tool call "
                                "needs one definition per name", f"tools[{i}]")
            definitions[name] = definition
        variants.append({"type": "object", "properties": {"name": {"type": "string", "enum": [tool.name]},
                                                          "parameters": parameters},
                         "required": ["name", "parameters"], "additionalProperties": False})
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": variants}}
    if not parallel:
        schema["maxItems"] = 1
    if definitions:
        schema["$defs"] = definitions
    return schema
