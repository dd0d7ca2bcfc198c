"""OpenAI's Responses API as the gateway's chat requests: a `/v1/responses` body validated strictly (fields the platform
does not serve are a 400 naming them), turned into the chat request the chat route would get (so admission, routing,
dispatch, tools and structured output are the chat path's own), and the chat answer turned back into a Response object.

What is stored for a response, and rebuilt into the next turn of a conversation, is its input items and output items in
the Responses shape (`stored_items`): the chat messages are derived from them each turn (`chat_messages`)."""

from __future__ import annotations

import secrets
import time
from typing import Any, Literal

from pydantic import Field, model_validator

from services.common.errors import APIError, bad_request
from services.common.validation import describe

from .schemas import MAX_INT32, FieldError, Strict, parse

# Fields of OpenAI's request the platform does not serve, each refused with why (null, false or empty: accepted as absent).
REFUSED = {
    "background": "background responses are not served here: wait for the answer (or stream it), or use the Batch API",
    "reasoning": "reasoning options are for reasoning models; the models served here have none",
    "conversation": "conversation objects are not served here: chain turns with previous_response_id",
    "prompt": "stored prompt templates are not served here: send the instructions and input",
    "context_management": "server-side context compaction is not served here (truncation: auto drops the oldest turns)",
    "prompt_cache_retention": "prompt cache retention is not configurable here: the engines' prefix caches keep what fits",
    "prompt_cache_options": "prompt cache options are not configurable here: the engines' prefix caches keep what fits",
    "moderation": "moderation is not served here",
    "image": "image generation options are not served here",
    "access_programs": "programmatic tool calling is not served here",
    "background_options": "background responses are not served here",
}
INCLUDABLE = ("message.output_text.logprobs",)  # what `include` may ask for: what maps onto the chat answer
ITEM_TYPES = ("message", "function_call", "function_call_output")
INPUT_PART_TYPES = ("input_text", "output_text")


class InputText(Strict):
    type: Literal["input_text", "output_text"]
    text: str
    annotations: list | None = None  # an output_text part given back as input
    logprobs: list | None = None


class MessageItem(Strict):
    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: str | list[InputText]
    id: str | None = Field(None, max_length=64)
    status: Literal["in_progress", "completed", "incomplete"] | None = None
    phase: Literal["commentary", "final_answer"] | None = None


class FunctionCallItem(Strict):
    type: Literal["function_call"]
    call_id: str = Field(min_length=1, max_length=256)
    name: str = Field(min_length=1, max_length=64)
    arguments: str
    id: str | None = Field(None, max_length=64)
    status: Literal["in_progress", "completed", "incomplete"] | None = None


class FunctionCallOutputItem(Strict):
    type: Literal["function_call_output"]
    call_id: str = Field(min_length=1, max_length=256)
    output: str | list[InputText]
    id: str | None = Field(None, max_length=64)
    status: Literal["in_progress", "completed", "incomplete"] | None = None


ITEM_MODELS = {"message": MessageItem, "function_call": FunctionCallItem, "function_call_output": FunctionCallOutputItem}


class FunctionTool(Strict):
    type: Literal["function"]
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.-]+$")
    description: str | None = None
    parameters: dict | None = None
    strict: bool | None = None


class NamedFunction(Strict):
    type: Literal["function"]
    name: str


class TextFormat(Strict):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = Field(None, min_length=1, max_length=64)
    schema_: dict | None = Field(None, alias="schema")
    description: str | None = None
    strict: bool | None = None

    @model_validator(mode="after")
    def _schema(self) -> "TextFormat":
        if self.type == "json_schema" and (self.schema_ is None or self.name is None):
            raise ValueError("type json_schema needs name and schema")
        if self.type != "json_schema" and (self.schema_ is not None or self.name is not None or self.strict is not None):
            raise ValueError(f"name, schema and strict go with type json_schema, not {self.type}")
        return self


class TextConfig(Strict):
    format: TextFormat | None = None


class StreamOptions(Strict):
    include_obfuscation: bool = False  # nothing is obfuscated here: the stream carries no obfuscation field


class ResponsesRequest(Strict):
    model: str
    input: str | list[MessageItem | FunctionCallItem | FunctionCallOutputItem] = Field(min_length=1)
    instructions: str | None = None
    max_output_tokens: int | None = Field(None, ge=1, le=MAX_INT32)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedFunction | None = None
    parallel_tool_calls: bool | None = None
    max_tool_calls: int | None = Field(None, ge=1, le=128)
    text: TextConfig | None = None
    metadata: dict[str, str] | None = None
    user: str | None = Field(None, max_length=512)
    safety_identifier: str | None = Field(None, max_length=64)  # an end user's id, like user: kept with the response
    store: bool = True
    previous_response_id: str | None = Field(None, pattern=r"^[A-Za-z0-9_-]{1,64}$")
    stream: bool = False
    stream_options: StreamOptions | None = None
    top_logprobs: int | None = Field(None, ge=0, le=20)
    include: list[Literal["message.output_text.logprobs"]] | None = None
    prompt_cache_key: str | None = Field(None, max_length=64)  # passed to the chat request: a hint to cache-aware routing
    truncation: Literal["auto", "disabled"] | None = None
    service_tier: Literal["auto", "default"] | None = None
    ignore_eos: bool = False  # vLLM's extension (its Responses API has it too): generate max_output_tokens in full

    @model_validator(mode="after")
    def _combinations(self):
        if self.stream_options is not None and not self.stream:
            raise FieldError("stream_options", "stream_options needs stream: true")
        if self.tool_choice is not None and self.tool_choice != "none" and not self.tools:
            raise FieldError("tool_choice", "tool_choice needs tools")
        if isinstance(self.tool_choice, NamedFunction) and self.tool_choice.name not in {t.name for t in self.tools or ()}:
            raise FieldError("tool_choice", f"tool_choice names the function {self.tool_choice.name!r}, which is not in tools")
        if self.metadata is not None and (len(self.metadata) > 16 or any(len(k) > 64 or len(v) > 512 for k, v in self.metadata.items())):
            raise FieldError("metadata", "metadata is at most 16 keys of up to 64 characters, each a string of up to 512")
        return self

    def logprobs(self) -> bool:
        return self.top_logprobs is not None or bool(self.include)


# ---- the request ---------------------------------------------------------------------------------
def _check_types(data: dict) -> None:
    """What the schema would refuse with a union's error, said plainly: built-in tools, other item and part types."""
    for name, why in REFUSED.items():
        if data.get(name) not in (None, False, [], {}):
            raise bad_request(f"{name} is not supported: {why}", param=name, code="unsupported_parameter")
    include = data.get("include")
    if isinstance(include, list):
        for i, value in enumerate(include):
            if value not in INCLUDABLE:
                raise bad_request(f"include[{i}] {value!r} is not served here; include may ask for {', '.join(INCLUDABLE)}",
                                  param=f"include.{i}", code="unsupported_parameter")
    tools = data.get("tools")
    if isinstance(tools, list):
        for i, tool in enumerate(tools):
            kind = tool.get("type") if isinstance(tool, dict) else None
            if kind != "function":
                raise bad_request(f"tools[{i}] is of type {kind!r}: only function tools are served here (built-in tools such "
                                  "as web search, file search or code interpreter are not)", param=f"tools.{i}.type",
                                  code="unsupported_parameter")
    choice = data.get("tool_choice")
    if isinstance(choice, dict) and choice.get("type") != "function":
        raise bad_request(f"tool_choice of type {choice.get('type')!r} is not served here: use none, auto, required or "
                          "{\"type\": \"function\", \"name\": ...}", param="tool_choice", code="unsupported_parameter")
    items = data.get("input")
    if "input" in data and not isinstance(items, (str, list)):
        raise bad_request(f"input must be a string or a list of items; got {describe(items)}", param="input", code="invalid_value")
    if isinstance(items, list):
        for i, item in enumerate(items):
            if not isinstance(item, dict):
                raise bad_request(f"input[{i}] must be an item: an object with a type (message, function_call, "
                                  f"function_call_output), or a message with a role and content; got {describe(item)}",
                                  param=f"input.{i}", code="invalid_value")
            kind = item.get("type", "message" if "role" in item else None)
            if kind not in ITEM_TYPES:
                raise bad_request(f"input[{i}] is of type {kind!r}: the input items served here are {', '.join(ITEM_TYPES)} "
                                  "(reasoning and built-in tool items are not)", param=f"input.{i}.type", code="unsupported_parameter")
            content = item.get("content") if kind == "message" else item.get("output") if kind == "function_call_output" else None
            for j, part in enumerate(content if isinstance(content, list) else ()):
                ptype = part.get("type") if isinstance(part, dict) else None
                if ptype not in INPUT_PART_TYPES:
                    where = "content" if kind == "message" else "output"
                    raise bad_request(f"input[{i}].{where}[{j}] is of type {ptype!r}: only text parts (input_text, output_text) "
                                      "are served here; the models here read text only", param=f"input.{i}.{where}.{j}.type",
                                      code="unsupported_parameter")


def parse_request(data: object, limits=None) -> ResponsesRequest:
    """A decoded body -> the request; with `limits` (config `limits`), its input items and tools are counted first,
    before the schema validates each of them (as admission counts a chat body's messages)."""
    if isinstance(data, dict):
        if limits is not None:
            for param, setting in (("input", "max_messages"), ("tools", "max_tools")):
                if isinstance(data.get(param), list) and len(data[param]) > getattr(limits, setting):
                    raise APIError(400, f"{param} has {len(data[param])} items; the limit is {getattr(limits, setting)} "
                                        f"(limits.{setting})", param=param, code="array_above_max_length")
            items = data.get("input")
            parts = sum(len(it[k]) for it in items if isinstance(it, dict) for k in ("content", "output")
                        if isinstance(it.get(k), list)) if isinstance(items, list) else 0
            if parts > limits.max_content_parts:
                raise APIError(400, f"input has {parts} content parts; the limit is {limits.max_content_parts} "
                                    "(limits.max_content_parts)", param="input", code="array_above_max_length")
        _check_types(data)
        items = data.get("input")
        for i, item in enumerate(items if isinstance(items, list) else ()):
            # each item against its own type first: a union's error would name the first member (str), not the item
            kind = ITEM_MODELS[item.get("type", "message")]
            try:
                parse(kind, item)
            except APIError as e:
                raise APIError(400, e.message.replace(f" {e.param}", f" input.{i}.{e.param}", 1) if e.param else e.message,
                               param=f"input.{i}.{e.param}" if e.param else f"input.{i}", code=e.code) from None
    return parse(ResponsesRequest, data)


def _text(content: str | list[InputText]) -> str:
    return content if isinstance(content, str) else "".join(p.text for p in content)


def item_id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(16)}"


def stored_items(req: ResponsesRequest) -> list[dict]:
    """The request's input as OpenAI lists input items: each with an id, in the Responses item shapes."""
    items = [MessageItem(role="user", content=req.input)] if isinstance(req.input, str) else req.input
    out = []
    for it in items:
        if isinstance(it, MessageItem):
            if it.role == "assistant":
                out.append({"id": it.id or item_id("msg"), "type": "message", "role": "assistant", "status": "completed",
                            "content": [{"type": "output_text", "text": _text(it.content), "annotations": []}]})
            else:
                out.append({"id": it.id or item_id("msg"), "type": "message", "role": it.role, "status": "completed",
                            "content": [{"type": "input_text", "text": _text(it.content)}]})
        elif isinstance(it, FunctionCallItem):
            out.append({"id": it.id or item_id("fc"), "type": "function_call", "call_id": it.call_id, "name": it.name,
                        "arguments": it.arguments, "status": "completed"})
        else:
            out.append({"id": it.id or item_id("fco"), "type": "function_call_output", "call_id": it.call_id,
                        "output": _text(it.output), "status": "completed"})
    return out


def chat_messages(items: list[dict]) -> list[dict]:
    """Stored items (a conversation's, oldest first) -> chat messages: consecutive function calls join the assistant
    turn before them as its tool_calls; each call's output is a tool message."""
    messages: list[dict] = []
    for it in items:
        if it["type"] == "message":
            messages.append({"role": it["role"], "content": "".join(p["text"] for p in it["content"])})
        elif it["type"] == "function_call":
            call = {"id": it["call_id"], "type": "function", "function": {"name": it["name"], "arguments": it["arguments"]}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        else:
            messages.append({"role": "tool", "tool_call_id": it["call_id"], "content": it["output"]})
    return messages


def chat_body(req: ResponsesRequest, history: list[dict], items: list[dict]) -> dict:
    """The chat request for this Responses request: the instructions, the conversation so far, then this input."""
    messages = ([{"role": "system", "content": req.instructions}] if req.instructions is not None else []) + chat_messages(history + items)
    body: dict[str, Any] = {"model": req.model, "messages": messages}
    for ours, theirs in (("max_output_tokens", "max_tokens"), ("temperature", "temperature"), ("top_p", "top_p"),
                         ("parallel_tool_calls", "parallel_tool_calls"), ("user", "user"), ("prompt_cache_key", "prompt_cache_key")):
        if getattr(req, ours) is not None:
            body[theirs] = getattr(req, ours)
    if req.tools:
        body["tools"] = [{"type": "function", "function": t.model_dump(exclude={"type"}, exclude_none=True)} for t in req.tools]
    if req.tool_choice is not None:
        body["tool_choice"] = req.tool_choice if isinstance(req.tool_choice, str) else {"type": "function", "function": {"name": req.tool_choice.name}}
    if req.max_tool_calls == 1 and req.tools:
        body["parallel_tool_calls"] = False
    fmt = req.text.format if req.text is not None else None
    if fmt is not None and fmt.type == "json_object":
        body["response_format"] = {"type": "json_object"}
    elif fmt is not None and fmt.type == "json_schema":
        schema = {"name": fmt.name, "schema": fmt.schema_} | ({"strict": fmt.strict} if fmt.strict is not None else {})
        body["response_format"] = {"type": "json_schema", "json_schema": schema | ({"description": fmt.description} if fmt.description else {})}
    if req.logprobs():
        body["logprobs"] = True
        body["top_logprobs"] = req.top_logprobs or 0
    if req.ignore_eos:
        body["ignore_eos"] = True
    if req.stream:
        body["stream"] = True
    return body


# chat request fields -> the Responses request's, for refusals that the chat validation or admission makes
PARAMS = {"messages": "input", "max_tokens": "max_output_tokens", "response_format": "text.format", "tools": "tools",
          "tool_choice": "tool_choice", "top_logprobs": "top_logprobs", "logprobs": "top_logprobs"}


def renamed_param(param: str | None) -> str | None:
    if param is None:
        return None
    if param.startswith("response_format.json_schema.schema"):
        return "text.format.schema"
    head, _, rest = param.partition(".")
    if head not in PARAMS:
        return param
    return PARAMS[head] if head == "messages" or not rest else f"{PARAMS[head]}.{rest}"


def renamed_message(message: str) -> str:
    return (message.replace("response_format.json_schema.schema", "text.format.schema").replace("max_tokens", "max_output_tokens")
            .replace("messages has", "input has (as chat messages)"))


def renamed(e: APIError) -> APIError:
    """A refusal of the derived chat request, naming the Responses field it came from."""
    if e.param is None or renamed_param(e.param) == e.param:
        return e
    return type(e)(e.status, renamed_message(e.message), e.type, renamed_param(e.param), e.code, e.headers)


def renamed_body(body: dict) -> dict:
    """An error body of the chat path (the engine's refusal), naming the Responses field."""
    error = body.get("error") or {}
    if error.get("param") is None:
        return body
    return {"error": error | {"param": renamed_param(error["param"]), "message": renamed_message(error.get("message", ""))}}


# ---- the response --------------------------------------------------------------------------------
def response_object(resp_id: str, req: ResponsesRequest, created_at: int, status: str = "in_progress", output: list | None = None,
                    usage: dict | None = None, incomplete: str | None = None, error: dict | None = None) -> dict:
    """OpenAI's Response object for `req` (fields its type declares, and only those)."""
    fmt = req.text.format if req.text is not None and req.text.format is not None else TextFormat(type="text")
    return {
        "id": resp_id, "object": "response", "created_at": created_at, "status": status,
        "completed_at": int(time.time()) if status == "completed" else None,
        "error": error, "incomplete_details": {"reason": incomplete} if incomplete else None,
        "instructions": req.instructions, "max_output_tokens": req.max_output_tokens, "max_tool_calls": req.max_tool_calls,
        "model": req.model, "output": output or [], "parallel_tool_calls": req.parallel_tool_calls is not False,
        "previous_response_id": req.previous_response_id, "temperature": 1.0 if req.temperature is None else req.temperature,
        "top_p": 1.0 if req.top_p is None else req.top_p, "top_logprobs": req.top_logprobs,
        "tool_choice": (req.tool_choice if isinstance(req.tool_choice, str) else req.tool_choice.model_dump())
        if req.tool_choice is not None else "auto",
        "tools": [t.model_dump(exclude_none=True) | {"strict": t.strict if t.strict is not None else True,
                                                      "parameters": t.parameters} for t in req.tools or ()],
        "text": {"format": fmt.model_dump(by_alias=True, exclude_none=True)}, "truncation": req.truncation or "disabled",
        "metadata": req.metadata or {}, "user": req.user, "safety_identifier": req.safety_identifier,
        "prompt_cache_key": req.prompt_cache_key, "service_tier": req.service_tier or "default", "background": False,
        "reasoning": None, "usage": usage,
    }


def usage_of(chat_usage: dict) -> dict:
    """Chat usage -> the Responses usage; cached tokens as the chat answer reports them (0 where it does not), and the
    prompt tokens the engine prefilled (its prefix cache keeps their blocks) as the cache writes, where it reports them."""
    reported = (chat_usage.get("prompt_tokens_details") or {}).get("cached_tokens")
    prompt, completion = chat_usage.get("prompt_tokens", 0), chat_usage.get("completion_tokens", 0)
    cached = reported or 0
    written = prompt - cached if reported is not None else 0
    return {"input_tokens": prompt, "input_tokens_details": {"cached_tokens": cached, "cache_write_tokens": written},
            "output_tokens": completion,
            "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": prompt + completion}


def logprobs_of(chat_logprobs: dict | None) -> list[dict]:
    """Chat logprobs -> the output_text part's."""
    def entry(t: dict) -> dict:
        return {"token": t["token"], "logprob": t["logprob"], "bytes": t["bytes"]}
    return [entry(t) | {"top_logprobs": [entry(a) for a in t.get("top_logprobs") or ()]}
            for t in (chat_logprobs or {}).get("content") or ()]


def status_of(finish_reason: str | None) -> tuple[str, str | None]:
    """(status, incomplete reason) of an answer that ended with `finish_reason`."""
    if finish_reason == "length":
        return "incomplete", "max_output_tokens"
    return "completed", None


def output_items(message: dict, finish_reason: str | None, logprobs: dict | None, max_tool_calls: int | None, want_logprobs: bool) -> list[dict]:
    """A chat answer's message -> output items: its text as one message item, then one function_call item per call."""
    items = []
    status = "incomplete" if finish_reason == "length" else "completed"
    text = message.get("content") or ""
    calls = message.get("tool_calls") or []
    if text or not calls:
        part = {"type": "output_text", "text": text, "annotations": []}
        if want_logprobs:
            part["logprobs"] = logprobs_of(logprobs)
        items.append({"id": item_id("msg"), "type": "message", "role": "assistant", "status": status, "content": [part]})
    for c in calls[:max_tool_calls]:
        items.append({"id": item_id("fc"), "type": "function_call", "call_id": c["id"], "name": c["function"]["name"],
                      "arguments": c["function"]["arguments"], "status": "completed"})
    return items


def from_chat(resp_id: str, req: ResponsesRequest, created_at: int, chat: dict) -> dict:
    """A whole chat.completion -> the Response."""
    choice = chat["choices"][0]
    status, incomplete = status_of(choice["finish_reason"])
    output = output_items(choice["message"], choice["finish_reason"], choice.get("logprobs"), req.max_tool_calls, req.logprobs())
    return response_object(resp_id, req, created_at, status, output, usage_of(chat.get("usage") or {}), incomplete)
