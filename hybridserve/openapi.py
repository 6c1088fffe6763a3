"""The OpenAPI description of the server: request bodies from the pydantic request models
(the handlers read the raw body themselves, so FastAPI cannot infer them), response bodies
and the error statuses each route may answer, in the OpenAI shapes. Schema fuzzers
(tests/hybridserve/test_fuzz.py) generate requests from it and check responses against it."""
from __future__ import annotations

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

from hybridserve.protocol import ChatRequest, CompletionRequest
from hybridserve.sampling import MAX_LOGPROBS

REF = "#/components/schemas/{model}"
STRING, INT = {"type": "string"}, {"type": "integer"}
NULLABLE_STRING = {"type": ["string", "null"]}

ERROR = {"type": "object", "required": ["error"], "properties": {"error": {
    "type": "object", "required": ["message", "type", "param", "code"],
    "properties": {"message": STRING, "type": STRING, "param": NULLABLE_STRING, "code": NULLABLE_STRING}}}}
USAGE = {"type": "object", "required": ["prompt_tokens", "completion_tokens", "total_tokens"], "properties": {
    "prompt_tokens": INT, "completion_tokens": INT, "total_tokens": INT,
    "prompt_tokens_details": {"type": "object", "properties": {"cached_tokens": INT}}}}
LOGPROBS = {"type": ["object", "null"]}
FINISH = {"type": ["string", "null"]}


def _response(obj: str, choice: dict) -> dict:
    return {"type": "object", "required": ["id", "object", "created", "model", "choices", "usage"], "properties": {
        "id": STRING, "object": {"const": obj}, "created": INT, "model": STRING, "usage": USAGE,
        "choices": {"type": "array", "items": {"type": "object", "required": ["index", "finish_reason", "logprobs"],
                                               "properties": {"index": INT, "finish_reason": FINISH,
                                                              "logprobs": LOGPROBS, **choice}}}}}


# one server-sent event: data is a chunk or an error as JSON, or the closing [DONE]
CHUNK = {"type": "object", "anyOf": [
    {"required": ["id", "object", "created", "model", "choices"],
     "properties": {"id": STRING, "object": STRING, "created": INT, "model": STRING,
                    "choices": {"type": "array", "items": {"type": "object"}}, "usage": USAGE}},
    {"$ref": REF.format(model="Error")}]}
EVENT = {"type": "object", "required": ["data"], "properties": {"data": {"anyOf": [
    {"const": "[DONE]"},
    {"type": "string", "contentMediaType": "application/json", "contentSchema": CHUNK}]}}}

SCHEMAS = {
    "Error": ERROR,
    "StreamEvent": EVENT,
    "CompletionResponse": _response("text_completion", {"text": STRING}),
    "ChatCompletionResponse": _response("chat.completion", {"message": {
        "type": "object", "required": ["role", "content"], "properties": {"role": STRING, "content": STRING}}}),
    "ModelList": {"type": "object", "required": ["object", "data"], "properties": {
        "object": {"const": "list"}, "data": {"type": "array", "items": {
            "type": "object", "required": ["id", "object", "created", "owned_by", "max_model_len"],
            "properties": {"id": STRING, "object": {"const": "model"}, "created": INT, "owned_by": STRING,
                           "max_model_len": INT}}}}},
    "Health": {"type": "object", "required": ["status"], "properties": {"status": {"const": "ok"}}},
}
WHY = {  # status -> when a route answers it
    400: "bad input (or a Host header that does not name this server)",
    401: "missing or wrong API key (with --api-key)",
    404: "unknown model",
    408: "a stream's reader fell too far behind",
    413: "request body over the size limit",
    409: "requests are running (the audit needs an idle engine)",
    415: "Content-Type is not application/json",
    500: "the engine failed while running the request (audit: a pool failed its integrity check)",
    503: "the engine is not running, the server is shutting down, or the request waited past the queue timeout",
}


def _ref(name: str) -> dict:
    return {"$ref": REF.format(model=name)}


def _errors(*statuses: int) -> dict:
    return {s: {"description": WHY[s], "content": {"application/json": {"schema": _ref("Error")}}} for s in statuses}


def _sampling_route(request: str, response: str, summary: str) -> dict:
    return {"summary": summary,
            "openapi_extra": {"requestBody": {"required": True,
                                              "content": {"application/json": {"schema": _ref(request)}}}},
            "responses": {200: {"description": "the completion (JSON), or server-sent events with stream=true",
                                "content": {"application/json": {"schema": _ref(response)},
                                            "text/event-stream": {"schema": _ref("StreamEvent")}}},
                          **_errors(400, 401, 404, 408, 413, 415, 500, 503)}}


ROUTES = {
    "completions": _sampling_route("CompletionRequest", "CompletionResponse", "Text completion of one prompt"),
    "chat": _sampling_route("ChatRequest", "ChatCompletionResponse", "Chat completion"),
    "models": {"summary": "The served model", "responses": {
        200: {"description": "the model list", "content": {"application/json": {"schema": _ref("ModelList")}}},
        **_errors(400, 401)}},
    "health": {"summary": "Liveness of the engine", "responses": {
        200: {"description": "the engine runs", "content": {"application/json": {"schema": _ref("Health")}}},
        **_errors(400, 503)}},
    "audit": {"summary": "Debug (--debug-integrity): flush the cache, check every pool, count what is held",
              "responses": {200: {"description": "what is still held after the flush (all 0: no leak)",
                                  "content": {"application/json": {"schema": {
                                      "type": "object", "additionalProperties": INT}}}},
                            **_errors(401, 409, 500)}},
    "metrics": {"summary": "Prometheus metrics", "responses": {
        200: {"description": "Prometheus text exposition", "content": {"text/plain": {"schema": STRING}}},
        **_errors(400)}},
}


def route_docs(name: str) -> dict:
    """Keyword arguments of a route decorator that describe it (summary, body, responses)."""
    return ROUTES[name]


def openapi_schema(app: FastAPI) -> dict:
    """The app's OpenAPI document, with the request and response schemas as components and
    the ranges the server accepts (app.state.engine: the served model, its context and vocabulary)."""
    if app.openapi_schema is None:
        doc = get_openapi(title=app.title, version=app.version, routes=app.routes)
        schemas = doc.setdefault("components", {}).setdefault("schemas", {})
        engine = app.state.engine.info
        ranges = value_ranges(sorted({engine.model_name, engine.config.model}), engine.max_model_len - 1)
        for model in (CompletionRequest, ChatRequest):
            schema = model.model_json_schema(ref_template=REF)
            schemas.update(schema.pop("$defs", {}))
            for name, prop in schema["properties"].items():
                for branch in prop.get("anyOf", [prop]):
                    branch.update(ranges.get(name, {}).get(branch.get("type"), {}))
            schemas[model.__name__] = schema
        _constrain_prompt(schemas["CompletionRequest"]["properties"]["prompt"], engine.vocab_size - 1)
        schemas["ChatRequest"]["properties"]["messages"]["minItems"] = 1
        schemas.update(SCHEMAS)
        app.openapi_schema = doc
    return app.openapi_schema


def value_ranges(models: list[str], max_tokens: int) -> dict[str, dict[str, dict]]:
    """field -> JSON type -> the constraints SamplingParams and the engine enforce on it."""
    count = {"integer": {"minimum": 1, "maximum": max_tokens}}
    logprobs = {"integer": {"minimum": 0, "maximum": MAX_LOGPROBS}}
    zero = {"number": {"enum": [0]}, "integer": {"enum": [0]}}
    return {"model": {"string": {"enum": models}}, "max_tokens": count, "max_completion_tokens": count,
            "temperature": {"number": {"minimum": 0, "maximum": 100}},
            "top_p": {"number": {"exclusiveMinimum": 0, "maximum": 1}}, "top_k": {"integer": {"minimum": -1}},
            "seed": {"integer": {"minimum": 0, "maximum": 2**63 - 1}}, "n": {"integer": {"enum": [1]}},
            "presence_penalty": zero, "frequency_penalty": zero, "logprobs": logprobs, "top_logprobs": logprobs,
            "echo": {"boolean": {"enum": [False]}},
            "stop": {"string": {"minLength": 1}, "array": {"items": {"type": "string", "minLength": 1}}},
            "stop_token_ids": {"array": {"items": {"type": "integer", "minimum": 0}}}}


def _constrain_prompt(prop: dict, top_id: int) -> None:
    """A non-empty string or token-id list (ids in [0, top_id]); a list of prompts holds one."""
    ids = {"type": "array", "minItems": 1, "items": {"type": "integer", "minimum": 0, "maximum": top_id}}
    for branch in prop["anyOf"]:
        item = branch.get("items", {}).get("type")
        if branch["type"] == "string":
            branch["minLength"] = 1
        elif item == "integer":
            branch.update(ids)
        else:  # a list holding one prompt
            branch.update(minItems=1, maxItems=1, items={"type": "string", "minLength": 1} if item == "string" else ids)
