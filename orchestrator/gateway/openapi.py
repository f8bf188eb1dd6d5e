"""The gateway's OpenAPI document, served at ``/openapi.json``.

The handlers are plain Starlette endpoints that validate by hand (``request.py``), here and in the
routers other packages mount (disagg's role/pools, the planner's status, the fleet UI), so FastAPI
cannot derive their schemas: every route is described here. The request models below exist only to describe the API: they
mirror what ``request.py`` checks (and say that other OpenAI/vLLM fields pass through to the
engine); they are never run on a request. The document is built once per app, on first use.
Clients, docs and the schema-driven fuzz tests (tests/fuzz) read it.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

_PASS_THROUGH = ConfigDict(extra="allow", json_schema_extra={"additionalProperties": True})


class StreamOptions(BaseModel):
    model_config = _PASS_THROUGH
    include_usage: bool | None = Field(None, description="Send a final chunk with token usage")


class _Common(BaseModel):
    model_config = _PASS_THROUGH
    model: str = Field(..., min_length=1, description="A model (or alias) the fleet serves")
    stream: bool | None = Field(None, description="Server-sent events instead of one JSON answer")
    stream_options: StreamOptions | None = None
    max_tokens: int | None = Field(None, ge=1, description="Most tokens to generate")
    n: int | None = Field(None, ge=1)
    temperature: float | None = None
    top_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    user: str | None = None


class ChatMessage(BaseModel):
    model_config = _PASS_THROUGH
    role: str = Field(..., description="system, user, assistant, tool, ...")
    content: str | list[dict[str, Any]] | None = Field(None, description="Text, or an array of content parts")


class ChatCompletionRequest(_Common):
    """OpenAI chat completions; any other field is forwarded to the engine unchanged."""

    messages: list[ChatMessage] = Field(..., min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)


class CompletionRequest(_Common):
    """OpenAI (legacy) completions; any other field is forwarded to the engine unchanged."""

    prompt: str | list[str] | list[int] | list[list[int]] = Field(
        ..., description="A string, strings, token ids, or arrays of token ids (non-empty)")


class ResponsesRequest(BaseModel):
    """OpenAI Responses API (``responses_api.py``); any other field is forwarded to the engine unchanged
    (``request_id`` and the adapters' internal fields are refused)."""

    model_config = _PASS_THROUGH
    model: str = Field(..., min_length=1, description="A model (or alias) the fleet serves")
    input: str | list[dict[str, Any]] = Field(..., description=(
        "Text, or an array of input items; a message item (type absent or \"message\") has a string role and "
        "content that is a string or an array of content-part objects; any item's or part's type is a string"))
    instructions: str | None = Field(None, description="A system message placed before the input")
    max_output_tokens: int | None = Field(None, ge=1, description="Most tokens to generate")
    stream: bool | None = Field(None, description="Typed server-sent events instead of one JSON answer")
    previous_response_id: str | None = Field(None, min_length=1, max_length=256,
                                             description="Continue a stored response (sent to its engine)")
    temperature: float | None = None
    top_p: float | None = None
    user: str | None = None


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | int | None = None


class ErrorResponse(BaseModel):
    error: ErrorDetail


class WorkerRequest(BaseModel):
    """A worker as in the configuration file (``workers[]``)."""

    model_config = ConfigDict(extra="forbid")
    url: str = Field(..., description="http:// or https:// base URL of the engine")
    id: str | None = None
    engine: Literal["vllm", "sglang", "sim"] = "vllm"
    role: Literal["prefill", "decode", "both"] = "both"
    models: list[str] = Field(default_factory=list)
    labels: dict[str, str] = Field(default_factory=dict)


class RoleChangeRequest(BaseModel):
    """Move a worker between the prefill and decode pools (``orchestrator/disagg/admin_routes.py``)."""

    model_config = ConfigDict(extra="allow")
    role: Literal["prefill", "decode", "both"]
    wait: bool = Field(False, description="Answer once the role is applied (200) instead of at once (202)")


_MODELS = (ChatCompletionRequest, CompletionRequest, ResponsesRequest, ChatMessage, StreamOptions, ErrorDetail, ErrorResponse,
           WorkerRequest, RoleChangeRequest)


def _ref(name: str) -> dict[str, str]:
    return {"$ref": f"#/components/schemas/{name}"}


def _errors(*statuses: int) -> dict[str, Any]:
    return {str(s): {"description": desc, "content": {"application/json": {"schema": _ref("ErrorResponse")}}}
            for s, desc in ((400, "Invalid request (the error's param names the field)"),
                            (401, "Missing or wrong key"), (403, "Model not allowed for this key"),
                            (404, "Unknown model, worker or route"), (408, "Request headers or body too slow"),
                            (409, "Conflicts with the fleet's state (a pending role change, the last decoder)"),
                            (413, "Body larger than gateway.max_body_bytes"),
                            (429, "Rate limited (Retry-After)"),
                            (503, "No worker can serve it now, or the gateway is draining (Retry-After)"))
            if s in statuses}


def _json_ok(desc: str, schema: dict[str, Any] | None = None) -> dict[str, Any]:
    return {"200": {"description": desc, "content": {"application/json": {"schema": schema or {"type": "object"}}}}}


def build_openapi(title: str = "Dyad gateway", version: str = "0") -> dict[str, Any]:
    schemas: dict[str, Any] = {}
    for model in _MODELS:
        schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
        schemas.update(schema.pop("$defs", {}))
        schemas[model.__name__] = schema
    admin = [{"adminToken": []}]
    client_errors = _errors(400, 401, 403, 404, 408, 413, 429, 503)

    def completion(op: str, model: str, summary: str) -> dict[str, Any]:
        ok = {"description": "The engine's answer (JSON), or server-sent events when stream is true",
              "content": {"application/json": {"schema": {"type": "object"}},
                          "text/event-stream": {"schema": {"type": "string"}}}}
        return {"post": {"operationId": op, "summary": summary, "security": [{"apiKey": []}, {}],
                         "requestBody": {"required": True,
                                         "content": {"application/json": {"schema": _ref(model)}}},
                         "responses": {"200": ok, **client_errors}}}

    def passthrough(op: str, summary: str) -> dict[str, Any]:
        body = {"type": "object", "required": ["model"], "properties": {"model": {"type": "string", "minLength": 1}},
                "additionalProperties": True}
        return {"post": {"operationId": op, "summary": summary, "security": [{"apiKey": []}, {}],
                         "requestBody": {"required": True, "content": {"application/json": {"schema": body}}},
                         "responses": {**_json_ok("The engine's answer"), **client_errors}}}

    worker_id = [{"name": "worker_id", "in": "path", "required": True, "schema": {"type": "string"}}]
    response_id = [{"name": "response_id", "in": "path", "required": True,
                    "schema": {"type": "string", "minLength": 1, "maxLength": 256}}]
    stored = {**_json_ok("The stored response, from the engine that created it"), **_errors(400, 401, 404)}
    paths = {
        "/v1/chat/completions": completion("createChatCompletion", "ChatCompletionRequest", "Chat completion"),
        "/v1/completions": completion("createCompletion", "CompletionRequest", "Text completion"),
        "/v1/responses": completion("createResponse", "ResponsesRequest", "Responses API (typed events when streamed)"),
        "/v1/responses/{response_id}": {"get": {
            "operationId": "getResponse", "security": [{"apiKey": []}, {}], "parameters": [
                *response_id, {"name": "stream", "in": "query", "required": False, "schema": {"type": "boolean"}},
                {"name": "starting_after", "in": "query", "required": False,
                 "schema": {"type": "integer", "minimum": 0}}],
            "responses": stored}},
        "/v1/responses/{response_id}/cancel": {"post": {
            "operationId": "cancelResponse", "security": [{"apiKey": []}, {}], "parameters": response_id,
            "responses": stored}},
        "/v1/embeddings": passthrough("createEmbedding", "Embeddings (routed by model to one worker)"),
        "/tokenize": passthrough("tokenize", "The engine's tokenizer (routed by model to one worker)"),
        "/detokenize": passthrough("detokenize", "The engine's detokenizer (routed by model to one worker)"),
        "/v1/models": {"get": {"operationId": "listModels", "security": [{"apiKey": []}, {}],
                               "responses": {**_json_ok("Models the fleet serves"), **_errors(401)}}},
        "/health": {"get": {"operationId": "health", "responses": _json_ok("The process is up")}},
        "/ready": {"get": {"operationId": "ready", "responses": {
            **_json_ok("Every model has a healthy worker"),
            "503": {"description": "Not ready (no healthy worker for a model, or draining)",
                    "content": {"application/json": {"schema": {"type": "object"}}}}}}},
        "/metrics": {"get": {"operationId": "metrics", "responses": {"200": {
            "description": "Prometheus exposition", "content": {"text/plain": {"schema": {"type": "string"}}}}}}},
        "/admin/workers": {
            "get": {"operationId": "listWorkers", "security": admin,
                    "responses": {**_json_ok("Workers and their state"), **_errors(401, 404)}},
            "post": {"operationId": "addWorker", "security": admin,
                     "requestBody": {"required": True, "content": {"application/json": {"schema": _ref("WorkerRequest")}}},
                     "responses": {"201": {"description": "Added (probed at once)",
                                           "content": {"application/json": {"schema": {"type": "object"}}}},
                                   "409": {"description": "Id taken",
                                           "content": {"application/json": {"schema": _ref("ErrorResponse")}}},
                                   **_errors(400, 401, 404, 413)}}},
        "/admin/workers/{worker_id}": {"delete": {"operationId": "removeWorker", "security": admin,
                                                  "parameters": worker_id,
                                                  "responses": {**_json_ok("Removed"), **_errors(401, 404)}}},
        "/admin/workers/{worker_id}/drain": {"post": {
            "operationId": "drainWorker", "security": admin, "parameters": worker_id,
            "responses": {**_json_ok("Draining: nothing new, finishes what it has"), **_errors(401, 404)}}},
        "/admin/workers/{worker_id}/undrain": {"post": {
            "operationId": "undrainWorker", "security": admin, "parameters": worker_id,
            "responses": {**_json_ok("Back in rotation (when healthy)"), **_errors(401, 404)}}},
        "/admin/discovery": {"get": {"operationId": "discoveryStatus", "security": admin, "responses": {
            **_json_ok("The discovery source's state and last error (why the list in force is kept)"),
            **_errors(401, 404)}}},
        # orchestrator/disagg/admin_routes.py
        "/admin/workers/{worker_id}/role": {"post": {
            "operationId": "setWorkerRole", "security": admin, "parameters": worker_id,
            "requestBody": {"required": True,
                            "content": {"application/json": {"schema": _ref("RoleChangeRequest")}}},
            "responses": {**_json_ok("Role applied (wait: true, or nothing to drain)"),
                          "202": {"description": "Pending: the worker drains its current work first",
                                  "content": {"application/json": {"schema": {"type": "object"}}}},
                          **_errors(400, 401, 404, 409, 413)}}},
        "/admin/pools": {"get": {"operationId": "listPools", "security": admin, "responses": {
            **_json_ok("Worker ids per role, and those moving between roles"), **_errors(400, 401)}}},
        # orchestrator/planner/routes.py
        "/admin/planner": {"get": {"operationId": "plannerStatus", "security": admin, "responses": {
            **_json_ok("The planner's targets, limits and recent decisions"), **_errors(401, 404)}}},
        # orchestrator/ui/routes.py
        "/ui": {"get": {"operationId": "fleetPage", "responses": {"200": {
            "description": "The live fleet page", "content": {"text/html": {"schema": {"type": "string"}}}}}}},
        # (the admin token when the gateway has one: orchestrator/ui/routes.py)
        "/ui/api/state": {"get": {"operationId": "fleetState", "security": [*admin, {}],
                                  "responses": _json_ok("Workers, routing and the planner, as the page shows them")}},
        "/ui/api/history": {"get": {"operationId": "fleetHistory", "security": [*admin, {}], "responses": _json_ok(
            "The last hour of traffic points (rates, error ratio, TTFT/ITL quantiles, prefix hit), in memory")}},
    }
    return {
        "openapi": "3.1.0",
        "info": {"title": title, "version": version,
                 "description": "OpenAI-compatible gateway in front of vLLM/SGLang engines. Fields not listed "
                                "in a request schema are forwarded to the engine unchanged."},
        "paths": paths,
        "components": {"schemas": schemas, "securitySchemes": {
            "apiKey": {"type": "http", "scheme": "bearer", "description": "Client key (when configured)"},
            "adminToken": {"type": "http", "scheme": "bearer", "description": "gateway.admin_token"}}},
    }
