"""What the trainer's routes accept (they parse their own requests, to answer in OpenAI's envelope), for its
/openapi.json; merged into FastAPI's document by services.common.openapi.document."""

from __future__ import annotations

from services.common import files_api
from services.common.openapi import json_body, page_params

from .api import JOB_FIELDS
from .hyperparameters import DistillationHyperparameters

_HYPERPARAMETERS = DistillationHyperparameters.request_schema()
_METHOD = {"type": ["object", "null"], "additionalProperties": False, "required": ["type"], "properties": {
    "type": {"const": "distillation"},
    "distillation": {"type": ["object", "null"], "additionalProperties": False, "properties": {"hyperparameters": _HYPERPARAMETERS}}}}
_JOB = {"type": "object", "additionalProperties": False, "required": ["model", "training_file"], "properties": {
    "model": {"type": "string", "minLength": 1}, "training_file": {"type": "string", "minLength": 1},
    "validation_file": {"type": ["string", "null"]}, "method": _METHOD,
    "suffix": {"type": ["string", "null"], "pattern": "^[A-Za-z0-9_-]{1,64}$"},
    "seed": {"type": ["integer", "null"], "minimum": 0, "maximum": 2**31 - 1},
    "metadata": {"type": ["object", "null"], "maxProperties": 16, "propertyNames": {"maxLength": 64},
                 "additionalProperties": {"type": "string", "maxLength": 512}},
    "hyperparameters": {"type": "null"}, "integrations": {"type": "null"}}}
assert set(_JOB["properties"]) == JOB_FIELDS

OPERATIONS = {
    **files_api.openapi_operations(),  # the platform's one Files API, as the gateway has it
    ("post", "/v1/fine_tuning/jobs"): {"summary": "Create a SwiftKV distillation job", "requestBody": json_body(_JOB)},
    ("get", "/v1/fine_tuning/jobs"): {"summary": "List jobs", "parameters": page_params(100)},
    ("get", "/v1/fine_tuning/jobs/{job_id}/events"): {"summary": "A job's events", "parameters": page_params(1000)},
    ("get", "/v1/fine_tuning/jobs/{job_id}/checkpoints"): {"summary": "A job's checkpoints", "parameters": page_params(1000)},
}
