"""OpenAI-compatible completions for a raywright model, on Ray Serve.

    POST /v1/completions   prompt, max_tokens, temperature, top_p, stop, seed, stream (SSE)
    GET  /v1/models        the served model
    GET  /health, /ready   liveness and readiness (no API key)

``build_app(args)`` is the application builder for ``serve deploy`` / ``serve run``
(``import_path: serve.app:build_app``); ``args`` are the fields of ServeConfig.
Bad requests get a 4xx naming the field, before any work is queued.
"""

import asyncio
import json
import secrets
import time
from collections.abc import AsyncIterator
from typing import Any

import torch
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from ray import serve
from ray.serve.metrics import Counter, Gauge, Histogram

from serve.config import ServeConfig, serve_config_from_dict
from serve.decoder import Decoder
from serve.engine import Chunk, ContinuousBatcher, Engine, GenerationParams, Sequence
from train import storage
from train.export import export_uri, load_exported
from train.hf_gpt2 import CONFIG

api = FastAPI(title="raywright")


class CompletionRequest(BaseModel):
    # Strict: "4" is not a number and unknown fields are errors, so typos never pass silently.
    model_config = ConfigDict(extra="forbid", strict=True)

    prompt: str = Field(min_length=1)
    model: str | None = None
    max_tokens: int = Field(16, ge=1)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    stop: str | list[str] | None = Field(None, max_length=4)
    seed: int | None = None
    stream: bool = False


def error_response(status: int, message: str, param: str | None = None, **headers: str) -> JSONResponse:
    kind = "invalid_request_error" if status < 500 else "server_error"
    body = {"error": {"message": message, "type": kind, "param": param, "code": None}}
    return JSONResponse(body, status_code=status, headers=headers or None)


class RequestError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param = status, message, param


def parse_request(body: bytes) -> CompletionRequest:
    try:
        return CompletionRequest.model_validate_json(body or b"{}")
    except ValidationError as exc:
        first = exc.errors()[0]
        if first["type"] == "json_invalid":
            raise RequestError(400, "the request body is not valid JSON") from None
        param = str(first["loc"][0]) if first["loc"] else None
        raise RequestError(400, f"{param or 'body'}: {first['msg']}", param) from None


def resolve_export(checkpoint: str) -> str:
    """A model directory (a training export or any GPT-2 HF directory), given itself or the run dir holding it."""
    if storage.exists(storage.join(checkpoint, CONFIG)):
        return checkpoint
    if storage.exists(storage.join(export_uri(checkpoint), CONFIG)):
        return export_uri(checkpoint)
    raise FileNotFoundError(f"checkpoint: no {CONFIG} in {checkpoint} or in its export/ directory")


@serve.deployment
@serve.ingress(api)
class CompletionServer:
    def __init__(self, config: dict[str, Any]):
        cfg = serve_config_from_dict(config)
        torch.set_num_threads(cfg.torch_threads)
        device = "cuda" if cfg.device == "cuda" or (cfg.device == "auto" and torch.cuda.is_available()) else "cpu"
        exported = load_exported(resolve_export(cfg.checkpoint))
        self.model_name = cfg.model_name or exported.name
        self.precision = "int8" if cfg.precision == "auto" else cfg.precision
        self.context = exported.model.cfg.seq_len
        self.tokenizer = exported.tokenizer
        max_batch = 1 if cfg.batching == "none" else cfg.max_batch_size
        self.engine = Engine(Decoder(exported.model, max_batch, self.precision, device), self.tokenizer)
        self.batching = cfg.batching
        self.batcher = ContinuousBatcher(self.engine, on_step=self._record_step)
        self.serve_batch_lock = asyncio.Lock()
        self._generate_serve_batch.set_max_batch_size(cfg.max_batch_size)
        self._generate_serve_batch.set_batch_wait_timeout_s(cfg.batch_wait_timeout_s)
        self.api_key = cfg.resolved_api_key()
        self.created = int(time.time())
        self.latency = Histogram(
            "raywright_request_latency_s",
            description="Seconds from a completion request to its last token.",
            boundaries=[0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30],
        )
        self.tokens = Counter("raywright_generated_tokens", description="Tokens generated (rate = tokens/s).")
        self.batch_size = Histogram(
            "raywright_batch_size", description="Sequences per decode step.", boundaries=[1, 2, 4, 8, 16, 32, 64]
        )
        self.queue_depth = Gauge("raywright_queue_depth", description="Requests waiting for a batch slot.")

    def _record_step(self, batch_size: int, queue_depth: int) -> None:
        self.tokens.inc(batch_size)
        self.batch_size.observe(batch_size)
        self.queue_depth.set(queue_depth)

    def _authorized(self, request: Request) -> bool:
        if not self.api_key:
            return True
        given = request.headers.get("authorization", "")
        return secrets.compare_digest(given.encode(), f"Bearer {self.api_key}".encode())

    @api.get("/health")
    def health(self) -> dict:
        return {"status": "ok"}

    @api.get("/ready")
    def ready(self) -> dict:
        return {"status": "ready", "model": self.model_name, "precision": self.precision}

    @api.get("/v1/models")
    def models(self, request: Request) -> Response:
        if not self._authorized(request):
            return error_response(401, "missing or wrong API key (Authorization: Bearer ...)")
        card = {"id": self.model_name, "object": "model", "created": self.created, "owned_by": "raywright"}
        return JSONResponse({"object": "list", "data": [card]})

    @api.post("/v1/completions")
    async def completions(self, request: Request) -> Response:
        if not self._authorized(request):
            return error_response(401, "missing or wrong API key (Authorization: Bearer ...)")
        try:
            body = parse_request(await request.body())
            prompt, params = self._validate(body)
        except RequestError as exc:
            return error_response(exc.status, exc.message, exc.param)
        chunks = self._generate(prompt, params)
        reply = {"id": f"cmpl-{secrets.token_hex(12)}", "object": "text_completion", "model": self.model_name}
        if body.stream:
            return StreamingResponse(self._sse(reply, chunks), media_type="text/event-stream")
        return await self._complete(reply, chunks, len(prompt))

    def _validate(self, body: CompletionRequest) -> tuple[list[int], GenerationParams]:
        if body.model is not None and body.model != self.model_name:
            raise RequestError(404, f"model: {body.model!r} is not served here; this server has {self.model_name!r}")
        prompt = [int(t) for t in self.tokenizer.encode(body.prompt)]
        if len(prompt) >= self.context:
            raise RequestError(400, f"prompt: {len(prompt)} tokens, the context is {self.context}", "prompt")
        if len(prompt) + body.max_tokens > self.context:
            raise RequestError(
                400,
                f"max_tokens: prompt ({len(prompt)} tokens) + max_tokens ({body.max_tokens}) exceeds "
                f"the context of {self.context} tokens",
                "max_tokens",
            )
        stop = [body.stop] if isinstance(body.stop, str) else body.stop or []
        return prompt, GenerationParams(body.max_tokens, body.temperature, body.top_p, stop, body.seed)

    async def _generate(self, prompt: list[int], params: GenerationParams) -> AsyncIterator[Chunk]:
        start = time.perf_counter()
        if self.batching == "serve_batch":
            yield await self._generate_serve_batch(Sequence(prompt, params))
        else:
            async for chunk in self.batcher.generate(prompt, params):
                yield chunk
        self.latency.observe(time.perf_counter() - start)

    @serve.batch(max_batch_size=32, batch_wait_timeout_s=0.01)
    async def _generate_serve_batch(self, batch: list[Sequence]) -> list[Chunk]:
        """The ``@serve.batch`` baseline of the benchmark: fixed batches run to completion, whole text at once."""
        async with self.serve_batch_lock:
            texts = await asyncio.to_thread(self.engine.run_batch, batch)
        self._record_step(len(batch), 0)
        return [Chunk(text, seq.finish_reason, seq.generated) for text, seq in zip(texts, batch, strict=True)]

    async def _complete(self, reply: dict, chunks: AsyncIterator[Chunk], prompt_tokens: int) -> Response:
        texts, finish, completion_tokens = [], None, 0
        async for chunk in chunks:
            texts.append(chunk.text)
            finish = chunk.finish_reason
            completion_tokens += chunk.tokens
        if finish == "error":
            return error_response(500, texts[-1])
        text = "".join(texts)
        choice = {"text": text, "index": 0, "logprobs": None, "finish_reason": finish}
        usage = {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
        }
        return JSONResponse({**reply, "created": int(time.time()), "choices": [choice], "usage": usage})

    async def _sse(self, reply: dict, chunks: AsyncIterator[Chunk]) -> AsyncIterator[str]:
        async for chunk in chunks:
            choice = {"text": chunk.text, "index": 0, "logprobs": None, "finish_reason": chunk.finish_reason}
            yield f"data: {json.dumps({**reply, 'created': int(time.time()), 'choices': [choice]})}\n\n"
        yield "data: [DONE]\n\n"


def build_app(args: dict[str, Any]):
    """Serve application builder: ``args`` are ServeConfig fields."""
    cfg = serve_config_from_dict(args)
    return deployment_for(cfg).bind(cfg.to_dict())


def deployment_for(cfg: ServeConfig):
    gpu = cfg.device == "cuda" or (cfg.device == "auto" and torch.cuda.is_available())
    return CompletionServer.options(
        max_ongoing_requests=cfg.max_ongoing_requests,
        max_queued_requests=cfg.max_queued_requests,
        backpressure_config={"status_code": 429, "retry_after_s": cfg.retry_after_s},
        autoscaling_config={
            "min_replicas": cfg.min_replicas,
            "max_replicas": cfg.max_replicas,
            "target_ongoing_requests": cfg.target_ongoing_requests,
        },
        ray_actor_options={"num_cpus": cfg.cpus_per_replica, "num_gpus": 1 if gpu else 0},
    )
