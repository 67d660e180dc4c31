"""Tool calling for the chat and Responses APIs: the request's tools and ``tool_choice``
(:mod:`~tripath.server.http.tools.schema`, :mod:`~tripath.server.http.tools.plan`) and the parsers that turn a model's
output into tool calls (:mod:`~tripath.server.http.tools.base`, :mod:`~tripath.server.http.tools.formats`, on
:mod:`~tripath.server.http.tools.json_scan`)."""

from tripath.server.http.tools.base import ToolCall, ToolParser
from tripath.server.http.tools.formats import PARSERS
from tripath.server.http.tools.plan import ChoiceToolStream, ToolPlan, ToolSettings, chat_message, plan_tools
from tripath.server.http.tools.schema import ToolError

__all__ = ["PARSERS", "ChoiceToolStream", "ToolCall", "ToolError", "ToolParser", "ToolPlan", "ToolSettings",
           "chat_message", "plan_tools"]
