"""Tools for agent episodes: what a tool is (`base`), running calls off the event loop with a
limit, an output cap and simulated latency (`runner`), the built-ins `calc` and `python` (in
the code sandbox), user tools as `pkg.mod:fn` (`registry`), reading calls out of the model's
text and writing results back (`formats`), and token-exact chat turn wrappers (`chat_ids`)."""

from areal.tools.base import Tool, ToolArgumentError, ToolCall, ToolError, ToolTimeout, tool
from areal.tools.formats import ChatFormat, ParsedTurn, TagsFormat, make_format
from areal.tools.registry import BUILTIN_TOOLS, ToolSpecError, resolve_tools
from areal.tools.runner import SimulatedLatency, ToolRunner

__all__ = [
    "BUILTIN_TOOLS",
    "ChatFormat",
    "ParsedTurn",
    "SimulatedLatency",
    "TagsFormat",
    "Tool",
    "ToolArgumentError",
    "ToolCall",
    "ToolError",
    "ToolRunner",
    "ToolSpecError",
    "ToolTimeout",
    "make_format",
    "resolve_tools",
    "tool",
]
