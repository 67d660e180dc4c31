"""Tool calling for the chat and Responses APIs: the request's tools and ``tool_choice``
(:mod:`~tripath.server.tools.schema`, :mod:`~tripath.server.tools.plan`) and the parsers that turn a model's
output into tool calls (:mod:`~tripath.server.tools.base`, :mod:`~tripath.server.tools.formats`, on
:mod:`~tripath.server.tools.json_scan`)."""

from tripath.server.tools.base import ToolCall, ToolParser
from tripath.server.tools.formats import PARSERS
from tripath.server.tools.plan import ChoiceToolStream, ToolPlan, ToolSettings, chat_message, plan_tools
from tripath.server.tools.schema import ToolError

__all__ = ["PARSERS", "ChoiceToolStream", "ToolCall", "ToolError", "ToolParser", "ToolPlan", "ToolSettings",
           "chat_message", "plan_tools"]
