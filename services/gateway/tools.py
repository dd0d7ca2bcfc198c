"""Tool calls as vLLM's OpenAI server makes them.

With a tool-call parser in the pool's config (`tool_call_parser: hermes`, one of vLLM's), the request goes
through vLLM's own parser machinery exactly as `vllm serve --enable-auto-tool-choice --tool-call-parser`
does: the parser adjusts the request (the constraint for `required`, a named function, or `auto`: a
structural tag or JSON schema for vLLM's structured-output backends; whether special tokens are kept), then
extracts the calls from the answer, whole or as streamed deltas.

Without a parser, `required` and a named function still work as in vLLM, and without vLLM installed: the
answer is constrained to the JSON vLLM derives from the tools (`tools_json_schema`, as vLLM's
`get_json_schema_from_tools`: the named function's parameters, or an array of `{name, parameters}`) and
turned into `tool_calls` here; `auto` is refused (nothing could find calls in the model's own format).
`none`: tools go to the chat template, the answer is plain content.

finish_reason is `tool_calls` when `auto` called a tool and for `required`, `stop` for a named function,
as vLLM and OpenAI do.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import secrets
from typing import Any

from services.common.errors import bad_request

from .schemas import ChatCompletionRequest

log = logging.getLogger("swiftkv.gateway")


def vllm_installed() -> bool:
    """Whether vLLM can be imported here, found without importing it (the gateway image has no vLLM)."""
    try:
        return importlib.util.find_spec("vllm") is not None
    except (ImportError, ValueError):  # a blocked import (ImportError) or a module set to None in sys.modules
        return False


def vllm_refusals() -> tuple[type[Exception], ...]:
    """What vLLM raises for a request it refuses (its validation errors are not all ValueErrors)."""
    from vllm.exceptions import VLLMClientError

    return (ValueError, TypeError, VLLMClientError)


def tool_call_id() -> str:
    return f"chatcmpl-tool-{secrets.token_hex(16)}"


def parser_class(name: str):
    """vLLM's tool-call parser class registered under `name` (ValueError naming the known ones if none)."""
    try:
        from vllm.tool_parsers import ToolParserManager
    except ImportError:
        raise ValueError(f"tool_call_parser {name!r} is one of vLLM's parsers, and vLLM is not installed where the "
                         "gateway runs; leave tool_call_parser out (tool_choice required and named functions work "
                         "without it) or run the gateway where vLLM is installed") from None

    try:
        return ToolParserManager.get_tool_parser(name)
    except KeyError:
        raise ValueError(f"unknown tool_call_parser {name!r}; vLLM has: {', '.join(sorted(ToolParserManager.list_registered()))}")


def _parameters(params: dict | None) -> dict:
    """A function's parameters, empty or missing ones as an object with no properties (arguments are an object)."""
    return params if params else {"type": "object", "properties": {}}


def tools_json_schema(req: ChatCompletionRequest) -> dict:
    """The JSON an answer must be for tool_choice `required` or a named function, derived as vLLM's
    `get_json_schema_from_tools` derives it (the answers stay the same as vLLM's server gives): the named
    function's parameters; for `required`, an array of one or more (one with parallel_tool_calls false)
    `{name, parameters}` objects, every function's `$defs` gathered at the top."""
    if req.tool_mode() == "named":
        by_name = {t.function.name: t for t in req.tools}  # the last of a name, as in vLLM
        return _parameters(by_name[req.tool_choice.function.name].function.parameters)
    choices, defs = [], {}
    for t in req.tools:
        # A copy: its `$defs` move to the top, while the request's own tools still go to the chat template.
        params = dict(t.function.parameters) if t.function.parameters is not None else None
        choices.append({"properties": {"name": {"type": "string", "enum": [t.function.name]}, "parameters": _parameters(params)},
                        "required": ["name", "parameters"]})
        own = params.pop("$defs", {}) if params is not None else {}
        if not isinstance(own, dict):
            raise bad_request(f"tools: `$defs` in the parameters of tool {t.function.name!r} must be an object, "
                              f"got {type(own).__name__}", param="tools")
        for name, schema in own.items():
            if name in defs and defs[name] != schema:
                raise bad_request(f"tools: the definition {name!r} has several schemas, which is not supported", param="tools")
            defs[name] = schema
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"type": "object", "anyOf": choices}}
    if req.parallel_tool_calls is False:
        schema["maxItems"] = 1
    if defs:
        schema["$defs"] = defs
    return schema


def _vllm_request(req: ChatCompletionRequest):
    """vLLM's own request object with what its tool helpers and parsers read (tools, tool_choice, the constraint)."""
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest as VllmChatRequest

    body = req.model_dump(include={"model", "tools", "tool_choice", "parallel_tool_calls", "response_format"},
                          exclude_none=True, by_alias=True)
    if req.structured_outputs is not None:
        body["structured_outputs"] = req.structured_outputs.params()
    try:
        return VllmChatRequest.model_validate(body | {"messages": [{"role": "user", "content": ""}]})
    except vllm_refusals() as e:  # what vLLM's own request validation refuses (pydantic's errors are ValueErrors)
        raise bad_request(f"tools: {e}", param="tools")


class ToolCalls:
    """One chat request's tools: the constraint for the engine and the extraction of calls per choice."""

    def __init__(self, req: ChatCompletionRequest, parser_name: str | None, tokenizer):
        self.mode = req.tool_mode()  # "auto" | "required" | "named"
        self.vreq = None  # vLLM's request, which its parsers read
        self.named = req.tool_choice.function.name if self.mode == "named" else None
        self.structured: dict | None = None  # vLLM StructuredOutputsParams fields; None: the request's own
        self.skip_special_tokens: bool | None = None
        self.tokenizer = tokenizer
        self.parser_cls = None
        if parser_name is not None:
            self._with_parser(req, parser_name)
        elif self.mode == "auto":
            raise bad_request(f"the model {req.model!r} has no tool-call format (no tool_call_parser in its pool's "
                              "config): tool_choice auto cannot find calls in its answers; use tool_choice "
                              "required or a named function, or none", param="tool_choice")
        else:
            self.structured = {"json": tools_json_schema(req)}
        self._streams: dict[int, _ChoiceStream] = {}

    def _with_parser(self, req: ChatCompletionRequest, parser_name: str) -> None:
        """vLLM's parser adjusts vLLM's request as its server does; what it set goes to the engine."""
        from vllm.parser.parser_manager import ParserManager

        self.vreq = _vllm_request(req)
        self.parser_cls = ParserManager.get_parser(tool_parser_name=parser_name, enable_auto_tools=True)
        before = self.vreq.extract_structured_outputs()
        try:
            self.vreq = self.parser_cls(self.tokenizer, self.vreq.tools).adjust_request(self.vreq)
        except vllm_refusals() as e:
            raise bad_request(f"tools: {e}", param="tools")
        after = self.vreq.extract_structured_outputs()
        if after is not None and after != before:
            self.structured = {k: v for k, v in vars(after).items() if not k.startswith("_") and v not in (None, False)}
        if self.vreq.skip_special_tokens is False:
            self.skip_special_tokens = False

    def _finish(self, finish_reason: str | None, called: bool) -> str | None:
        if finish_reason == "stop" and called and self.mode != "named":
            return "tool_calls"
        return finish_reason

    # ---- whole answers ---------------------------------------------------------------------------
    def message(self, text: str, finish_reason: str | None, token_ids: list[int] | None = None) -> tuple[dict, str | None]:
        """(the assistant message, finish_reason) for one choice's whole text."""
        if self.parser_cls is not None:
            parser = self.parser_cls(self.tokenizer, self.vreq.tools)
            try:
                _, content, found = parser.parse(text, self.vreq, enable_auto_tools=True, model_output_token_ids=token_ids or ())
            except Exception:  # a parser's own failure: the answer as text, as vLLM's parsers fall back
                log.exception("tool-call parser failed; answering with the text")
                return {"role": "assistant", "content": text}, finish_reason
            calls = [{"id": c.id or tool_call_id(), "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                     for c in found or []]
            if self.mode in ("named", "required"):
                content = content or ""
            message = {"role": "assistant", "content": content}
            if calls or self.mode in ("named", "required"):
                message["tool_calls"] = calls
            called = bool(calls) if self.mode == "auto" else self.mode == "required"
            return message, self._finish(finish_reason, called)
        if self.mode == "named":
            return {"role": "assistant", "content": "", "tool_calls": [self._call(self.named, text)]}, finish_reason
        calls = [self._call(c["name"], json.dumps(c["parameters"], ensure_ascii=False)) for c in _json_list(text)]
        return {"role": "assistant", "content": "", "tool_calls": calls}, self._finish(finish_reason, True)

    @staticmethod
    def _call(name: str, arguments: str) -> dict:
        return {"id": tool_call_id(), "type": "function", "function": {"name": name, "arguments": arguments}}

    # ---- streamed answers ------------------------------------------------------------------------
    def delta(self, index: int, text: str, finish_reason: str | None, token_ids: list[int] | None = None) -> tuple[dict | None, str | None]:
        """(the delta to send, or None for nothing yet; finish_reason) for one choice's new text."""
        stream = self._streams.get(index)
        if stream is None:
            stream = self._streams[index] = _ChoiceStream(self)
        return stream.delta(text, finish_reason, token_ids or [])


class _ChoiceStream:
    def __init__(self, calls: ToolCalls):
        self.calls = calls
        self.text = ""
        self.parser = calls.parser_cls(calls.tokenizer, calls.vreq.tools) if calls.parser_cls is not None else None
        self.name_sent = False
        self.streamed = False  # tool call deltas went out
        self.failed = False  # the parser failed: the rest goes out as text

    def delta(self, text: str, finish_reason: str | None, token_ids: list[int]) -> tuple[dict | None, str | None]:
        self.text += text
        calls = self.calls
        if self.failed:
            return ({"content": text} if text or not finish_reason else {}), finish_reason
        if self.parser is not None:  # vLLM's parser, as its server streams
            try:  # no reasoning parser: prompt ids [] end reasoning at once
                msg = self.parser.parse_delta(text, token_ids, calls.vreq, [], finished=finish_reason is not None)
            except Exception:  # a parser's own failure: the rest of the answer as text
                log.exception("tool-call parser failed while streaming; sending the text")
                self.failed = True
                return ({"content": text} if text or not finish_reason else {}), finish_reason
            if msg is not None and msg.tool_calls:
                self.streamed = True
            if msg is None:
                if finish_reason is None:
                    return None, None
                out: dict = {}
            else:
                out = msg.model_dump(exclude_none=True, exclude_unset=True)
                out.pop("reasoning", None)
            return out, calls._finish(finish_reason, self.streamed)
        if calls.mode == "named":
            if not text:
                return ({} if finish_reason else None), finish_reason
            if not self.name_sent:
                self.name_sent = True
                call: dict[str, Any] = {"index": 0, "id": tool_call_id(), "type": "function",
                                        "function": {"name": calls.named, "arguments": text}}
            else:
                call = {"index": 0, "function": {"arguments": text}}
            return {"tool_calls": [call]}, finish_reason
        # required: the array of calls goes out once it is whole
        if finish_reason is None:
            return None, None
        found = [{"index": i} | ToolCalls._call(c["name"], json.dumps(c["parameters"], ensure_ascii=False))
                 for i, c in enumerate(_json_list(self.text))]
        return ({"tool_calls": found} if found else {}), calls._finish(finish_reason, bool(found))


def _json_list(text: str) -> list[dict]:
    try:
        value = json.loads(text, strict=False)  # control characters in strings: some grammars let them through
    except (ValueError, RecursionError):
        return []  # cut short (max_tokens): no whole call to report
    return [c for c in value if isinstance(c, dict) and "name" in c] if isinstance(value, list) else []
