"""The OpenAI-compatible HTTP app over one shared Session: its routes, the engine's loading in the
background (requests get 503 until it is loaded) and errors in OpenAI's shape."""
from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import threading
import time
from contextlib import asynccontextmanager
from typing import Callable

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException

from kiln.runtime.arguments import ArgumentError
from kiln.runtime.chat_template import ChatTemplateError
from kiln.runtime.metrics import ServingMetrics
from kiln.runtime.openai.metrics import PrometheusExporter
from kiln.runtime.openai.protocol import Job, OpenAIError, parse_chat, parse_completion
from kiln.runtime.openai.responses import Responder
from kiln.runtime.openai.streaming import ClientGone, events, finals, outputs, until_disconnected
from kiln.runtime.sampling_params import SamplingParams
from kiln.runtime.session import Session

log = logging.getLogger("kiln.openai")
# Not an HTTP standard status, but the one servers log for "the client closed the request".
CLIENT_CLOSED = 499


@dataclasses.dataclass
class ServerState:
    """What the routes serve: the Session once loaded, or why it failed to load."""

    session: Session | None = None
    metrics: ServingMetrics | None = None
    failed: str | None = None


def create_app(load: Callable[[], Session], model_name: str,
               on_load_failure: Callable[[str], None] | None = None) -> FastAPI:
    """An app serving the Session that `load` returns under the name `model_name`. `load` runs on a
    thread of its own once the server starts, so the server answers (503) while the engine loads;
    a failed load is reported to `on_load_failure` and every request gets it as a 500. The Session
    is closed when the server stops."""
    state = ServerState()
    exporter = PrometheusExporter(model_name)

    def load_session() -> None:
        try:
            session = load()
        except Exception as e:
            state.failed = f"the engine failed to load: {e}"
            log.error(state.failed)
            if on_load_failure is not None:
                on_load_failure(state.failed)
            return
        state.metrics = ServingMetrics(exporter, lambda: session.stats)
        state.session = session  # last: the routes take a set session as loaded
        log.info("the engine is loaded: serving it as model %r", model_name)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        loader = threading.Thread(target=load_session, name="kiln-openai-load", daemon=True)
        loader.start()
        try:
            yield
        finally:
            await asyncio.to_thread(loader.join)
            if state.session is not None:
                await asyncio.to_thread(state.session.close)

    app = FastAPI(title="Kiln", lifespan=lifespan)
    app.state.kiln = state

    def ready() -> Session:
        if state.failed is not None:
            raise OpenAIError(500, state.failed, kind="server_error", code="engine_failed")
        if state.session is None:
            raise OpenAIError(503, "the engine is still loading: retry in a moment", kind="server_error",
                              code="engine_loading")
        return state.session

    @app.exception_handler(OpenAIError)
    async def openai_error(request: Request, e: OpenAIError) -> JSONResponse:
        return JSONResponse(e.body(), status_code=e.status)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, e: HTTPException) -> JSONResponse:
        found = e.status_code != 404
        message = e.detail if found else f"no route {request.method} {request.url.path}: see GET /v1/models"
        return JSONResponse(OpenAIError(e.status_code, str(message)).body(), status_code=e.status_code)

    @app.get("/health")
    async def health() -> dict:
        ready()
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics() -> Response:
        if state.metrics is not None:
            state.metrics.publish()
        return Response(exporter.text(), media_type=exporter.content_type)

    @app.get("/v1/models")
    async def models() -> dict:
        session = ready()
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": int(time.time()),
                                            "owned_by": "kiln", "max_model_len": session.max_seq_len}]}

    async def serve(request: Request, parse: Callable[[object], Job]) -> Response:
        session = ready()
        try:
            body = json.loads(await request.body())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise OpenAIError(400, f"the request body is not valid JSON: {e}") from None
        if isinstance(body, dict) and body.get("model") not in (None, model_name):
            raise OpenAIError(404, f"The model `{body['model']}` does not exist: this server serves `{model_name}`",
                              "model", "model_not_found")
        job = parse(body)
        prompts, params = _prompts(session, job)
        responder = Responder(job, model_name, session.tokenizer)
        stream = outputs(session, prompts, params, state.metrics)
        if job.stream:
            return StreamingResponse(events(responder, stream), media_type="text/event-stream")
        try:
            last = await until_disconnected(request, finals(stream, len(prompts)))
        except ClientGone:
            return Response(status_code=CLIENT_CLOSED)
        except RuntimeError as e:
            raise OpenAIError(500, f"Kiln could not finish this request: {e}", kind="server_error") from None
        return JSONResponse(responder.response(last))

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await serve(request, parse_completion)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await serve(request, parse_chat)

    return app


def _prompts(session: Session, job: Job) -> tuple[list[list[int]], SamplingParams]:
    """The job's prompts as token ids and the sampling parameters to run them with, every prompt
    checked by the Session before any runs."""
    params = job.params
    try:
        if job.chat:
            ids = session.apply_chat_template(job.prompts[0], tokenize=True)
            if not job.max_tokens_given:  # as much as the engine has room for
                room = session.max_seq_len - len(ids)
                if room < 1:
                    raise ArgumentError("prompt", f"has {len(ids)} tokens; the engine's max_seq_len is "
                                                  f"{session.max_seq_len}: shorten the conversation")
                params = dataclasses.replace(params, max_tokens=room)
            return [session.validate(sampling_params=params, prompt_token_ids=ids)], params
        many = len(job.prompts) > 1
        prompts = []
        for i, prompt in enumerate(job.prompts):
            text = isinstance(prompt, str)
            try:
                prompts.append(session.validate(prompt if text else None, params, None if text else prompt))
            except ArgumentError as e:
                raise ArgumentError(e.argument, f"{e.detail} (prompt {i})" if many else e.detail) from None
        return prompts, params
    except ArgumentError as e:
        raise job.error(e) from None
    except ChatTemplateError as e:
        raise OpenAIError(400, str(e), code="no_chat_template") from None
