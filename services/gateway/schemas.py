"""Request bodies of the OpenAI routes, validated strictly: unknown fields, values of the wrong JSON type
("16" for an integer, true for a number) and out-of-range values are a 400 that names the field, never a
silent default or coercion. Bounds follow OpenAI's and vLLM's; vLLM's extensions have vLLM's meaning."""

from __future__ import annotations

import dataclasses
import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from services.common.bodies import check_tree  # noqa: F401 (the gateway's modules import it from here)
from services.common.errors import bad_request
from services.serving.backend import SamplingOptions

MAX_INT32 = 2**31 - 1  # token counts: far above any context, small enough for every engine
MAX_SCHEMA_CHARS = 100_000  # a JSON schema, grammar or regex for structured output, serialized


_SAMPLING_FIELDS = tuple(f.name for f in dataclasses.fields(SamplingOptions))  # read once: fields() is not free

class FieldError(ValueError):
    """A check across fields: the message names the field `param` it is about."""

    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, protected_namespaces=())


class StreamOptions(Strict):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM: usage on every chunk


class TextPart(Strict):
    type: Literal["text"]
    text: str


class FunctionCall(Strict):
    name: str = Field(min_length=1, max_length=256)
    arguments: str


class ToolCall(Strict):
    id: str = Field(max_length=256)
    type: Literal["function"] = "function"
    function: FunctionCall


class Message(Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = Field(None, max_length=128)  # assistant turns that called tools
    tool_call_id: str | None = Field(None, max_length=256)  # tool turns: the call answered

    @model_validator(mode="after")
    def _shape(self) -> "Message":
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError("content is required (only an assistant message with tool_calls may leave it null)")
        if self.tool_calls and self.role != "assistant":
            raise ValueError("only assistant messages carry tool_calls")
        if self.role == "tool" and self.tool_call_id is None:
            raise ValueError("a tool message needs tool_call_id")
        return self

    def text(self) -> str:
        if self.content is None:
            return ""
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)

    def for_template(self) -> dict:
        """The message as chat templates expect it (vLLM's shape: tool call arguments as objects)."""
        m: dict[str, Any] = {"role": self.role if self.role != "developer" else "system", "content": self.text()}
        if self.name is not None:
            m["name"] = self.name
        if self.tool_calls:
            calls = []
            for c in self.tool_calls:
                try:
                    args = json.loads(c.function.arguments)
                except (ValueError, RecursionError):
                    args = c.function.arguments
                calls.append({"id": c.id, "type": "function", "function": {"name": c.function.name, "arguments": args}})
            m["tool_calls"] = calls
        if self.tool_call_id is not None:
            m["tool_call_id"] = self.tool_call_id
        return m


class JsonSchemaFormat(Strict):
    name: str = Field("response", min_length=1, max_length=64)
    description: str | None = None
    schema_: dict = Field(alias="schema")
    strict: bool | None = None


class ResponseFormat(Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema(self) -> "ResponseFormat":
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("type json_schema needs json_schema")
        if self.type != "json_schema" and self.json_schema is not None:
            raise ValueError(f"json_schema goes with type json_schema, not {self.type}")
        return self


class StructuredOutputs(Strict):
    """vLLM's `structured_outputs` request field: exactly one constraint, plus its options."""

    json_: dict | str | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = Field(None, min_length=1, max_length=1024)
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    whitespace_pattern: str | None = None

    @model_validator(mode="after")
    def _one(self) -> "StructuredOutputs":
        kinds = [k for k in ("json_", "regex", "choice", "grammar", "json_object") if getattr(self, k) is not None]
        if len(kinds) != 1:
            raise ValueError("give exactly one of json, regex, choice, grammar, json_object")
        if self.json_object is False:
            raise ValueError("json_object must be true when given (leave out structured_outputs for no constraint)")
        for k in ("json_", "grammar"):
            if isinstance(getattr(self, k), str) and not getattr(self, k).strip():
                raise ValueError(f"{k.rstrip('_')} must not be empty")
        return self

    def params(self) -> dict:
        d = self.model_dump(exclude_none=True, exclude_defaults=True)
        if "json_" in d:
            d["json"] = d.pop("json_")
        return d


class FunctionDef(Strict):
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.-]+$")
    description: str | None = None
    parameters: dict | None = None
    strict: bool | None = None


class Tool(Strict):
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(Strict):
    name: str


class NamedToolChoice(Strict):
    type: Literal["function"]
    function: NamedFunction


def _check_size(value, field: str):
    if value is not None and len(value if isinstance(value, str) else json.dumps(value)) > MAX_SCHEMA_CHARS:
        raise FieldError(field, f"{field} is larger than {MAX_SCHEMA_CHARS} characters")
    return value


class Sampling(Strict):
    model: str
    temperature: float = Field(1.0, ge=0, le=2)
    top_p: float = Field(1.0, gt=0, le=1)
    n: int = Field(1, ge=1)  # upper bound: limits.max_n (Admission.check_bounds)
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=-(2**63), le=2**63 - 1)  # the engine takes a signed 64-bit seed
    presence_penalty: float = Field(0.0, ge=-2, le=2)
    frequency_penalty: float = Field(0.0, ge=-2, le=2)
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # vLLM's extensions (its meaning and defaults)
    ignore_eos: bool = False
    top_k: int = Field(0, ge=-1, le=MAX_INT32)  # 0 or -1: every token
    min_p: float = Field(0.0, ge=0, le=1)
    repetition_penalty: float = Field(1.0, gt=0, le=10)
    min_tokens: int = Field(0, ge=0, le=MAX_INT32)
    stop_token_ids: list[int] | None = Field(None, max_length=64)
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    logit_bias: dict[str, float] | None = None  # entries: limits.max_logit_bias
    # lower runs first (engines with scheduling_policy=priority); below the key's min_priority (0 unless the keys file
    # says less) admission refuses: no tenant jumps the others' queue
    priority: int = Field(0, ge=-(2**31), le=MAX_INT32)
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    best_of: None = None  # vLLM's engine (v1) has no best_of: only null is accepted

    @field_validator("best_of", mode="before")
    @classmethod
    def _best_of(cls, v):
        if v is not None and v != 1:
            raise ValueError("best_of is not supported: vLLM's engine has no best_of; use n and pick on the client")
        return None

    @field_validator("logit_bias")
    @classmethod
    def _logit_bias(cls, v):
        for k, b in (v or {}).items():
            if not (k.isascii() and k.isdigit()):  # '²' and '١' are digits too, which int() refuses or reads
                raise ValueError(f"keys are token ids written as strings of the digits 0-9, not {k!r}")
            if not -100 <= b <= 100:
                raise ValueError(f"biases are between -100 and 100 (token {k}: {b})")
        return v

    @model_validator(mode="after")
    def _combinations(self):
        if self.stream_options is not None and not self.stream:
            raise FieldError("stream_options", "stream_options needs stream: true")
        if self.response_format is not None and self.response_format.type != "text" and self.structured_outputs is not None:
            raise FieldError("structured_outputs", "give response_format or structured_outputs, not both")
        if self.response_format is not None and self.response_format.json_schema is not None:
            _check_size(self.response_format.json_schema.schema_, "response_format.json_schema.schema")
        if self.structured_outputs is not None:
            for k in ("json_", "regex", "grammar", "choice", "whitespace_pattern"):
                _check_size(getattr(self.structured_outputs, k), f"structured_outputs.{k.rstrip('_')}")
        return self

    def structured(self) -> tuple[dict | None, str | None]:
        """vLLM's StructuredOutputsParams fields for this request, and the request field they came from."""
        if self.structured_outputs is not None:
            return self.structured_outputs.params(), "structured_outputs"
        rf = self.response_format
        if rf is None or rf.type == "text":
            return None, None
        if rf.type == "json_object":
            return {"json_object": True}, "response_format"
        return {"json": rf.json_schema.schema_}, "response_format.json_schema.schema"

    def logit_bias_ids(self) -> dict[int, float] | None:
        return {int(k): b for k, b in self.logit_bias.items()} if self.logit_bias else None

    def output_limit(self) -> int | None:
        """The output tokens the client asked for (None: as many as fit in the context)."""
        raise NotImplementedError

    def logprobs_k(self) -> int | None:
        """Top logprobs per token (0: only the chosen token's), None for none."""
        raise NotImplementedError

    def to_sampling_options(self, max_tokens: int, structured: dict | None = None,
                            skip_special_tokens: bool | None = None) -> SamplingOptions:
        """The engine's sampling options for this request. The gateway decides `max_tokens` (what the client asked
        for, or the room left in the context) and the constraint (the request's own, or the one its tools
        derive, which may also keep special tokens); fields whose request form differs are converted; every
        other field of SamplingOptions is this request's field of the same name."""
        converted = {
            "max_tokens": max_tokens, "structured": structured, "stop": self.stops(), "logprobs": self.logprobs_k(),
            "stop_token_ids": list(self.stop_token_ids or []), "logit_bias": self.logit_bias_ids(),
            "skip_special_tokens": self.skip_special_tokens if skip_special_tokens is None else skip_special_tokens,
        }
        same = {name: getattr(self, name) for name in _SAMPLING_FIELDS if name not in converted}
        return SamplingOptions(**same, **converted)

    @field_validator("stop")
    @classmethod
    def _stop(cls, v):
        if isinstance(v, list):  # how many and how long: limits.max_stop_sequences, limits.max_stop_chars
            if any(not s for s in v):
                raise ValueError("stop sequences must be non-empty")
        elif v == "":
            raise ValueError("stop sequences must be non-empty")
        return v

    def stops(self) -> list[str]:
        return [] if self.stop is None else [self.stop] if isinstance(self.stop, str) else list(self.stop)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        """vLLM: usage on every chunk (only with include_usage, as vLLM does)."""
        return self.include_usage and self.stream_options.continuous_usage_stats


class ChatCompletionRequest(Sampling):
    messages: list[Message] = Field(min_length=1)  # at most limits.max_messages
    max_tokens: int | None = Field(None, ge=1, le=MAX_INT32)
    max_completion_tokens: int | None = Field(None, ge=1, le=MAX_INT32)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    tools: list[Tool] | None = None  # at most limits.max_tools
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None  # with tool_choice required: false allows one call
    echo: bool = False  # vLLM: the last message's content (an assistant turn) starts the answer
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    # OpenAI's: requests sharing it likely share a prefix; a hint to cache-aware routing, per API key (RoutePolicy.decide)
    prompt_cache_key: str | None = Field(None, max_length=64)

    @model_validator(mode="after")
    def _chat_combinations(self):
        if self.continue_final_message and self.add_generation_prompt:
            raise FieldError("continue_final_message", "continue_final_message needs add_generation_prompt: false")
        if self.continue_final_message and self.messages[-1].role != "assistant":
            raise FieldError("continue_final_message", "continue_final_message needs an assistant message last")
        if self.tool_choice is not None and self.tool_choice != "none" and not self.tools:
            raise FieldError("tool_choice", "tool_choice needs tools")
        if isinstance(self.tool_choice, NamedToolChoice) and self.tool_choice.function.name not in {t.function.name for t in self.tools}:
            raise FieldError("tool_choice", f"tool_choice names the function {self.tool_choice.function.name!r}, which is not in tools")
        if self.tool_mode() in ("required", "named") and (self.response_format is not None and self.response_format.type != "text" or self.structured_outputs is not None):
            raise FieldError("tool_choice", "tool calls and response_format/structured_outputs cannot constrain the same answer")
        if self.tools:
            for t in self.tools:
                _check_size(t.function.parameters, f"tools.{t.function.name}.parameters")
        if self.chat_template_kwargs:
            _check_size(self.chat_template_kwargs, "chat_template_kwargs")
            clash = set(self.chat_template_kwargs) & RESERVED_TEMPLATE_KWARGS
            if clash:
                raise FieldError("chat_template_kwargs", f"chat_template_kwargs may not set {', '.join(sorted(clash))} (set by the request itself)")
        return self

    def tool_mode(self) -> str | None:
        """None (no tools in play), "auto", "required" or "named"."""
        if not self.tools or self.tool_choice == "none":
            return None
        if isinstance(self.tool_choice, NamedToolChoice):
            return "named"
        return self.tool_choice or "auto"

    def output_limit(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    def logprobs_k(self) -> int | None:
        if self.top_logprobs is not None and not self.logprobs:
            raise bad_request("top_logprobs requires logprobs: true", param="top_logprobs")
        return (self.top_logprobs or 0) if self.logprobs else None


RESERVED_TEMPLATE_KWARGS = {"messages", "conversation", "conversations", "tools", "documents", "chat_template",
                            "add_generation_prompt", "continue_final_message", "tokenize"}


class CompletionRequest(Sampling):
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = Field(16, ge=1, le=MAX_INT32)
    logprobs: int | None = Field(None, ge=0, le=5)
    echo: bool = False  # the prompt's text starts the answer
    suffix: str | None = None

    def output_limit(self) -> int | None:
        return self.max_tokens

    def logprobs_k(self) -> int | None:
        return self.logprobs


class TokenizeRequest(Strict):
    """vLLM's /tokenize: a prompt, or chat messages rendered with the chat template."""

    model: str | None = None
    prompt: str | None = None
    messages: list[Message] | None = Field(None, min_length=1)
    add_special_tokens: bool | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[Tool] | None = None  # at most limits.max_tools
    return_token_strs: bool = False

    @model_validator(mode="after")
    def _one(self) -> "TokenizeRequest":
        if (self.prompt is None) == (self.messages is None):
            raise FieldError("prompt", "give either prompt or messages")
        if self.chat_template_kwargs and set(self.chat_template_kwargs) & RESERVED_TEMPLATE_KWARGS:
            raise FieldError("chat_template_kwargs", "chat_template_kwargs may not set " + ", ".join(sorted(set(self.chat_template_kwargs) & RESERVED_TEMPLATE_KWARGS)))
        return self


class DetokenizeRequest(Strict):
    model: str | None = None
    tokens: list[int] = Field(max_length=1_000_000)


def _union_tag(part: str) -> bool:
    """pydantic names the member of a union in an error's location (`str`, `list[int]`): not a field."""
    return part in ("str", "int", "float", "bool") or part.startswith(("list[", "dict[", "function-"))


def parse(model: type[Strict], data: object):
    """Validate a decoded JSON body; the first problem becomes a 400 naming the field."""
    if not isinstance(data, dict):
        raise bad_request("the request body must be a JSON object")
    try:
        return model.model_validate(data)
    except ValidationError as e:
        err = e.errors(include_url=False)[0]
        loc = [str(p) for p in err["loc"] if not _union_tag(str(p))]
        param = ".".join(loc) or None
        cause = (err.get("ctx") or {}).get("error")
        if isinstance(cause, FieldError):
            param = ".".join(loc + [cause.param])
            raise bad_request(str(cause), param=param, code="invalid_value")
        if err["type"] == "extra_forbidden":
            message = f"unsupported field: {param}"
        elif err["type"] == "missing":
            message = f"missing required field: {param}"
        else:
            message = f"invalid value for {param}: {err['msg']}"
        raise bad_request(message, param=param, code="invalid_value" if err["type"] != "missing" else "missing_field")
