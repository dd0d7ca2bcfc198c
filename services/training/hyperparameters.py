"""A distillation job's hyperparameters (`method.distillation.hyperparameters`) as one typed model: the job API
validates requests with it, the trainer's OpenAPI document takes its schema from it, and it maps itself onto
`swiftkv_core.distill.DistillConfig`. Defaults are those of `swiftkv distill`; "auto" or null for a field means
its default. Names follow OpenAI's fine-tuning API where it has one (`learning_rate`, `batch_size`, `n_steps`
for its `n_epochs`' role); the model-dependent layout (num_key_value_layers, key_value_group_size) is checked
by swiftkv_core once the model is known (`for_model`)."""

from __future__ import annotations

import dataclasses
import typing
from typing import Literal

from annotated_types import Ge, Gt, Le, Lt
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from swiftkv_core.config import check_swiftkv_layout, default_num_key_value_layers
from swiftkv_core.distill import DistillConfig

_DEFAULT = {f.name: f.default for f in dataclasses.fields(DistillConfig)}


class HyperparameterError(ValueError):
    """A hyperparameter a request may not send; `field` names it."""

    def __init__(self, field: str, message: str):
        super().__init__(message)
        self.field = field


class DistillationHyperparameters(BaseModel):
    # strict: 1.5 is no integer and true no number (an integer is a number); infinities and NaN (which Python's JSON
    # parser reads) are out of every range
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False, frozen=True)

    # A field's serialization alias is its DistillConfig name where the two differ (distill_settings).
    num_key_value_layers: int | None = Field(
        None, ge=1, description="l: layers 0..l-1 keep their own KV; the later ones take it from layer l-1's output "
        "(default: half the model's layers)")
    key_value_group_size: int = Field(_DEFAULT["key_value_group_size"], ge=1,
                                      description="g: consecutive later layers sharing one KV cache (AcrossKV)")
    init: Literal["snowflake", "lstsq", "lstsq-qkv"] = Field(_DEFAULT["init"], description="initialisation of the SwiftKV projections")
    loss: Literal["kl", "lm"] = Field(_DEFAULT["loss"], description="KL against the teacher's logits, or the plain next-token loss")
    temperature: float = Field(_DEFAULT["temperature"], gt=0, le=100, description="temperature of the KL loss")
    learning_rate: float = Field(_DEFAULT["lr"], gt=0, lt=1, serialization_alias="lr",
                                 description="peak learning rate (AdamW, linear schedule with warm-up)")
    n_steps: int = Field(_DEFAULT["max_steps"], ge=1, le=1_000_000, serialization_alias="max_steps",
                         description="optimizer steps (the length of the learning-rate schedule)")
    batch_size: int = Field(_DEFAULT["batch_size"], ge=1, le=4096, description="packed sequences per step")
    seq_len: int = Field(_DEFAULT["seq_len"], ge=8, le=131072, description="tokens per packed sequence")
    min_top1_agreement: float | None = Field(
        None, ge=0, le=1, description="publish the model only if its top-1 agreement with the teacher reaches this")

    NOT_DISTILL_SETTINGS: typing.ClassVar[set[str]] = {"min_top1_agreement"}  # read by the job service itself

    @model_validator(mode="before")
    @classmethod
    def _auto_is_default(cls, data):
        return {k: v for k, v in data.items() if v != "auto" and v is not None} if isinstance(data, dict) else data

    @classmethod
    def from_request(cls, given: dict) -> DistillationHyperparameters:
        """The hyperparameters a request sent; HyperparameterError names the first bad one in the request's order."""
        for name in given:
            if name not in cls.model_fields:
                raise HyperparameterError(name, f"unknown hyperparameter '{name}'; known: {', '.join(cls.model_fields)}")
        try:
            return cls.model_validate(given)
        except ValidationError as e:
            bad = {err["loc"][0] for err in e.errors() if err["loc"]}
            name = next(n for n in given if n in bad)
            raise HyperparameterError(name, f"{name} must be {cls.rule(name)}, got {given[name]!r}") from None

    @classmethod
    def rule(cls, name: str) -> str:
        """What a field accepts, in words, from its type and bounds: "an integer from 1 to 4096", "'kl' or 'lm'"."""
        field = cls.model_fields[name]
        kinds = typing.get_args(field.annotation) or (field.annotation,)
        if typing.get_origin(field.annotation) is Literal:
            *rest, last = (repr(choice) for choice in kinds)
            return f"{', '.join(rest)} or {last}" if rest else last
        bound = {type(m): m for m in field.metadata}
        low = bound[Ge].ge if Ge in bound else bound[Gt].gt
        if int in kinds:
            return f"an integer from {low} to {bound[Le].le}" if Le in bound else "a positive integer" if low == 1 else f"an integer of at least {low}"
        high = bound[Le].le if Le in bound else bound[Lt].lt
        if Ge in bound and Le in bound:
            return f"a number from {low} to {high}"
        return f"a number in {'[' if Ge in bound else '('}{low}, {high}{']' if Le in bound else ')'}"

    @classmethod
    def request_schema(cls) -> dict:
        """The JSON schema of what a request may send: each field as typed and bounded here, "auto" or null."""
        properties = {}
        for name, prop in cls.model_json_schema()["properties"].items():
            kinds = [{k: v for k, v in kind.items() if k not in ("title", "default", "description")}
                     for kind in prop.get("anyOf", [prop]) if kind.get("type") != "null"]
            properties[name] = {"anyOf": [*kinds, {"const": "auto"}, {"type": "null"}]}
            properties[name] |= {k: prop[k] for k in ("description", "default") if prop.get(k) is not None}
        return {"type": ["object", "null"], "additionalProperties": False, "properties": properties}

    def for_model(self, num_hidden_layers: int) -> DistillationHyperparameters:
        """These settings for a model of `num_hidden_layers` layers: num_key_value_layers filled in (default: half the
        layers) and the layout checked by swiftkv_core (SwiftKVConfigError, its `field` naming the setting)."""
        l = self.num_key_value_layers
        if l is None:
            l = default_num_key_value_layers(num_hidden_layers)
        check_swiftkv_layout(num_hidden_layers, l, self.key_value_group_size, require_swiftkv_layers=True)
        return self.model_copy(update={"num_key_value_layers": l})

    def distill_settings(self) -> dict:
        """The DistillConfig fields these settings give (by their DistillConfig names); call on `for_model`'s result."""
        if self.num_key_value_layers is None:
            raise ValueError("num_key_value_layers is not set: take the settings from for_model(num_hidden_layers)")
        return self.model_dump(by_alias=True, exclude=self.NOT_DISTILL_SETTINGS)
