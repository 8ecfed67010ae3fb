"""OpenAI-compatible completions for a raywright model (or any GPT-2 directory), on Ray Serve.

    POST /v1/completions        prompt, max_tokens, temperature, top_p, stop, seed, n, logprobs, echo,
                                presence/frequency_penalty, user, stream (SSE) and stream_options
    POST /v1/chat/completions   messages, for models whose tokenizer declares a chat template
    GET  /v1/models             the served model
    GET  /health, /ready        liveness and readiness (no API key)

``build_app(args)`` is the application builder for ``serve deploy`` / ``serve run``
(``import_path: serve.app:build_app``); ``args`` are the fields of ServeConfig. The request
and response bodies are pydantic models (serve/api_bodies.py), so ``/openapi.json`` and ``/docs``
document the API. Bad requests get a 400 naming the field before any work is queued; no request can
fail another.
"""

import asyncio
import json
import logging
import secrets
import time
from collections.abc import AsyncIterator
from dataclasses import asdict, replace
from typing import Any

import torch
from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from jinja2 import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment
from ray import serve
from ray.serve.metrics import Counter, Gauge, Histogram

from serve.api_bodies import (
    TAGGED_FIELDS,
    ChatCompletionRequest,
    CompletionRequest,
    ErrorBody,
    ErrorDetail,
    SamplingFields,
)
from serve.config import ServeConfig, serve_config_from_dict
from serve.engine import Chunk, ContinuousBatcher, GenerationParams, Sequence, joined
from serve.engine_process import EngineProcess, EngineSpec
from serve.sampling import TokenLogprob
from train import storage
from train.export import export_name, read_provenance
from train.hf_gpt2 import read_json_object, read_model_config
from train.run_layout import resolve_export
from train.tokenizer import EOT, load_tokenizer

logger = logging.getLogger(__name__)
# How long past the request timeout a stopping replica waits: for the timed-out requests' own replies.
SHUTDOWN_MARGIN_S = 5.0

api = FastAPI(title="raywright", description="OpenAI-compatible completions of a GPT served by raywright.")


class ApiError(Exception):
    """A request the server answers with an error in OpenAI's shape."""

    def __init__(self, status: int, message: str, param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param = status, message, param


def error_response(status: int, message: str, param: str | None = None) -> JSONResponse:
    kind = "invalid_request_error" if status < 500 else "server_error"
    body = ErrorBody(error=ErrorDetail(message=message, type=kind, param=param))
    return JSONResponse(body.model_dump(), status_code=status)


@api.exception_handler(ApiError)
async def _api_error(request: Request, exc: ApiError) -> JSONResponse:
    return error_response(exc.status, exc.message, exc.param)


@api.exception_handler(RequestValidationError)
async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
    first = exc.errors()[0]
    if first["type"] == "json_invalid":
        return error_response(400, "the request body is not valid JSON")
    where = [str(part) for part in first["loc"][1:]]  # loc[0] is "body"
    if len(where) > 1 and where[0] in TAGGED_FIELDS:
        del where[1]  # the form the value took, which the message implies
    if not where:  # the body as a whole: not JSON (say, a form) or not an object
        return error_response(400, "the request body is not a JSON object")
    return error_response(400, f"{'.'.join(where)}: {first['msg']}", where[0])


class BodySizeLimit:
    """Refuse a body over the limit from its Content-Length, before authentication or parsing reads it.

    Plain ASGI: Starlette's ``BaseHTTPMiddleware`` cost ~3 ms per request here.
    """

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        # scope["app"], not the module's ``api``: Serve may run a copy of the app made when it pickled the class.
        limit = getattr(scope["app"].state, "max_request_bytes", None) if "app" in scope else None
        if scope["type"] == "http" and scope["method"] == "POST" and limit is not None:
            length = dict(scope["headers"]).get(b"content-length")
            if length is None:
                await error_response(411, "send the body with a Content-Length header")(scope, receive, send)
                return
            if not length.isdigit() or int(length) > limit:
                await error_response(413, f"the request body is over the limit of {limit} bytes")(scope, receive, send)
                return
        await self.app(scope, receive, send)


api.add_middleware(BodySizeLimit)


async def require_api_key(request: Request) -> None:
    """Checked before the body is validated: without the key, nothing about the request is answered.

    ``async``: FastAPI runs a plain function dependency in a thread pool, a hop per request.
    """
    key = request.app.state.api_key
    given = request.headers.get("authorization", "")
    if key and not secrets.compare_digest(given.encode(), f"Bearer {key}".encode()):
        raise ApiError(401, "missing or wrong API key (Authorization: Bearer ...)")


def chat_template(location: str) -> str | None:
    """The chat template a model directory's tokenizer_config.json declares, if any."""
    template = (read_json_object(storage.join(location, "tokenizer_config.json")) or {}).get("chat_template")
    return template if isinstance(template, str) else None


def _token_text(data: bytes) -> str:
    return data.decode("utf-8", errors="backslashreplace")  # a token may hold part of a character


@serve.deployment
@serve.ingress(api)
class CompletionServer:
    def __init__(self, config: dict[str, Any]):
        cfg = serve_config_from_dict(config)
        device = cfg.resolved_device(torch.cuda.is_available())
        location = resolve_export(cfg.checkpoint)
        self.model_name = cfg.model_name or export_name(location, read_provenance(location))
        self.precision = cfg.resolved_precision(device)
        self.context = read_model_config(location).seq_len
        self.tokenizer = load_tokenizer(location)
        template = chat_template(location)
        environment = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        self.chat_template = environment.from_string(template) if template else None
        max_batch = 1 if cfg.batching == "none" else cfg.max_batch_size
        self.batching = cfg.batching
        spec = EngineSpec(location, max_batch, self.precision, device, cfg.cuda_graphs, cfg.compile, cfg.torch_threads)
        self.batcher: EngineProcess | ContinuousBatcher
        if cfg.batching == "serve_batch":  # the benchmark's baseline runs fixed batches here, in-process
            self.engine = spec.build()
            self.batcher = ContinuousBatcher(self.engine, on_step=self._record_step)
        else:
            self.batcher = EngineProcess(spec, on_step=self._record_step)
        self.serve_batch_lock = asyncio.Lock()
        self._generate_serve_batch.set_max_batch_size(cfg.max_batch_size)
        self._generate_serve_batch.set_batch_wait_timeout_s(cfg.batch_wait_timeout_s)
        self.request_timeout_s = cfg.request_timeout_s
        api.state.api_key = cfg.resolved_api_key()
        api.state.max_request_bytes = cfg.max_request_bytes
        self.created = int(time.time())
        self.generated_tokens = 0
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

    def __del__(self) -> None:
        """Serve's shutdown of the replica: the engine process goes with it (it would also see the socket close)."""
        if isinstance(getattr(self, "batcher", None), EngineProcess):
            self.batcher.close()

    def check_health(self) -> None:
        """Serve's health check: a replica whose decode loop died is replaced."""
        failure = self.batcher.loop_failed
        if failure is not None:
            raise RuntimeError(f"the decode loop stopped: {failure!r}")

    def _record_step(self, batch_size: int, queue_depth: int) -> None:
        self.generated_tokens += batch_size
        if batch_size:  # Ray's Counter refuses an increment of 0
            self.tokens.inc(batch_size)
            self.batch_size.observe(batch_size)
        self.queue_depth.set(queue_depth)

    @api.get("/health")
    def health(self) -> dict:
        return {"status": "ok"}

    @api.get("/ready")
    def ready(self) -> dict:
        """Readiness, and this replica's load: sequences decoding, requests waiting, tokens generated so far,
        where its decode loop's time went (serve/engine.py, LoopTimes), and its engine process."""
        return {
            "status": "ready",
            "model": self.model_name,
            "precision": self.precision,
            "in_flight": self.batcher.in_flight,
            "waiting": self.batcher.queue_depth,
            "generated_tokens": self.generated_tokens,
            "decode_loop": asdict(self.batcher.times),
            "engine_pid": self.batcher.process.pid if isinstance(self.batcher, EngineProcess) else None,
        }

    @api.get("/v1/models", dependencies=[Depends(require_api_key)])
    def models(self) -> dict:
        card = {"id": self.model_name, "object": "model", "created": self.created, "owned_by": "raywright"}
        return {"object": "list", "data": [card]}

    @api.post("/v1/completions", dependencies=[Depends(require_api_key)], responses={400: {"model": ErrorBody}})
    async def completions(self, body: CompletionRequest) -> Response:
        if body.max_tokens == 0 and not body.echo:
            raise ApiError(
                400,
                "max_tokens: 0 returns nothing without echo (with echo and logprobs, it scores the prompt)",
                "max_tokens",
            )
        named = body.prompts()
        tokens = [self._prompt_tokens(body, prompt, name) for name, prompt in named.items()]
        prompts = list(named.values())
        params = self._params(body, body.logprobs, prompt_logprobs=body.echo and body.logprobs is not None)
        reply = {"id": f"cmpl-{secrets.token_hex(12)}", "object": "text_completion", "model": self.model_name}

        def choice(index: int, seq: Sequence, text: str, finish: str | None, logprobs: list, first: bool) -> dict:
            with_prompt = first and body.echo
            echo = ""
            if with_prompt:
                prompt = prompts[index // body.n]
                echo = prompt if isinstance(prompt, str) else self.tokenizer.decode(prompt).decode(errors="replace")
            out = {"text": echo + text, "index": index, "logprobs": None, "finish_reason": finish}
            if body.logprobs is not None:
                prompt_part = [None, *seq.prompt_logprobs] if with_prompt else []
                out["logprobs"] = self._completion_logprobs(seq.prompt if with_prompt else [], prompt_part, logprobs)
            return out

        return await self._respond(body, reply, tokens, params, choice)

    @api.post("/v1/chat/completions", dependencies=[Depends(require_api_key)], responses={400: {"model": ErrorBody}})
    async def chat_completions(self, body: ChatCompletionRequest) -> Response:
        if self.chat_template is None:
            raise ApiError(400, f"model {self.model_name!r} declares no chat template; use /v1/completions", "messages")
        messages = [m.model_dump() for m in body.messages]
        try:
            text = self.chat_template.render(messages=messages, add_generation_prompt=True, eos_token=EOT)
        except TemplateError:
            raise ApiError(400, "the model's chat template cannot render these messages", "messages") from None
        prompt = self._prompt_tokens(body, text, param="messages")
        params = self._params(body, (body.top_logprobs or 0) if body.logprobs else None)
        reply = {"id": f"chatcmpl-{secrets.token_hex(12)}", "object": "chat.completion", "model": self.model_name}

        def choice(index: int, seq: Sequence, text: str, finish: str | None, logprobs: list, first: bool) -> dict:
            message = {"role": "assistant", "content": text}
            content = [self._chat_logprob(lp) for lp in logprobs] if body.logprobs else None
            return {
                "index": index,
                "delta" if body.stream else "message": message,
                "logprobs": None if content is None else {"content": content},
                "finish_reason": finish,
            }

        return await self._respond(body, reply, [prompt], params, choice)

    def _prompt_tokens(self, body: SamplingFields, prompt: str | list[int], param: str = "prompt") -> list[int]:
        """The tokens of a prompt (text, or token ids checked against the vocabulary) that fit the context."""
        if body.model is not None and body.model != self.model_name:
            raise ApiError(
                404, f"model: {body.model!r} is not served here; this server has {self.model_name!r}", "model"
            )
        if isinstance(prompt, str):
            prompt = [int(t) for t in self.tokenizer.encode(prompt)]
        else:
            vocab = self.tokenizer.vocab_size
            unknown = next((t for t in prompt if not 0 <= t < vocab), None)
            if unknown is not None:
                raise ApiError(400, f"{param}: token id {unknown} is not in the vocabulary (0-{vocab - 1})", param)
        if not prompt:
            raise ApiError(400, f"{param}: the text encodes to no tokens", param)
        if len(prompt) >= self.context:
            raise ApiError(400, f"{param}: {len(prompt)} tokens, the context is {self.context}", param)
        if len(prompt) + body.max_tokens > self.context:
            raise ApiError(
                400,
                f"max_tokens: prompt ({len(prompt)} tokens) + max_tokens ({body.max_tokens}) exceeds "
                f"the context of {self.context} tokens",
                "max_tokens",
            )
        return prompt

    def _params(self, body: SamplingFields, logprobs: int | None, prompt_logprobs: bool = False) -> GenerationParams:
        return GenerationParams(
            max_tokens=body.max_tokens,
            temperature=body.temperature,
            top_p=body.top_p,
            stop=body.stops(),
            seed=body.seed,
            presence_penalty=body.presence_penalty,
            frequency_penalty=body.frequency_penalty,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
        )

    def _completion_logprobs(
        self, prompt: list[int], prompt_part: list[TokenLogprob | None], generated: list[TokenLogprob]
    ) -> dict:
        """OpenAI's legacy completions logprobs: tokens, their logprobs, the top alternatives and text offsets."""
        tokens = [*prompt, *(lp.token for lp in generated)]
        entries = [*prompt_part, *generated]
        texts = [_token_text(self.tokenizer.decode([t])) for t in tokens]
        offsets, at = [], 0
        for text in texts:
            offsets.append(at)
            at += len(text)
        return {
            "tokens": texts,
            "token_logprobs": [lp.logprob if lp else None for lp in entries],
            "top_logprobs": [
                {_token_text(self.tokenizer.decode([t])): v for t, v in lp.top} if lp else None for lp in entries
            ],
            "text_offset": offsets,
        }

    def _chat_logprob(self, lp: TokenLogprob) -> dict:
        def entry(token: int, logprob: float) -> dict:
            data = self.tokenizer.decode([token])
            return {"token": _token_text(data), "logprob": logprob, "bytes": list(data)}

        return {**entry(lp.token, lp.logprob), "top_logprobs": [entry(t, v) for t, v in lp.top]}

    async def _respond(self, body: SamplingFields, reply: dict, prompts: list[list[int]], params, choice) -> Response:
        """Run ``n`` generations of each prompt; a JSON body, or SSE chunks (each choice's tokens as they come).
        Choice ``p * n + i`` is prompt p's i-th, seeded ``seed + i``: a prompt gets the same texts in a batch.

        ``choice(index, sequence, text, finish_reason, logprobs, first)`` formats one choice.
        """
        seeds = [None if params.seed is None else params.seed + i for i in range(body.n)]
        sequences = [Sequence(prompt, replace(params, seed=seed)) for prompt in prompts for seed in seeds]
        prompt_tokens = sum(len(prompt) for prompt in prompts)
        if body.stream:
            usage = body.stream_options is not None and body.stream_options.include_usage
            events = self._sse(reply, sequences, choice, prompt_tokens, usage)
            return StreamingResponse(events, media_type="text/event-stream")
        start = time.perf_counter()
        results = await asyncio.gather(*(self._collect(seq) for seq in sequences))
        self.latency.observe(time.perf_counter() - start)
        for chunks in results:
            if chunks[-1].finish_reason in ("error", "timeout"):
                return error_response(504 if chunks[-1].finish_reason == "timeout" else 500, chunks[-1].text)
        choices = []
        for index, (seq, chunks) in enumerate(zip(sequences, results, strict=True)):
            text, logprobs = "".join(c.text for c in chunks), [lp for c in chunks for lp in c.logprobs]
            choices.append(choice(index, seq, text, chunks[-1].finish_reason, logprobs, True))
        usage = self._usage(prompt_tokens, sum(c.tokens for chunks in results for c in chunks))
        return JSONResponse({**reply, "created": int(time.time()), "choices": choices, "usage": usage})

    @staticmethod
    def _usage(prompt_tokens: int, completion_tokens: int) -> dict:
        return {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
        }

    def _chunks(self, seq: Sequence, whole: bool = False) -> AsyncIterator[Chunk]:
        if self.batching == "serve_batch":
            return self._serve_batch_chunks(seq)
        return self.batcher.generate(seq, self.request_timeout_s, whole)

    async def _collect(self, seq: Sequence) -> list[Chunk]:
        return [chunk async for chunk in self._chunks(seq, whole=True)]

    async def _serve_batch_chunks(self, seq: Sequence) -> AsyncIterator[Chunk]:
        yield await self._generate_serve_batch(seq)

    @serve.batch(max_batch_size=32, batch_wait_timeout_s=0.01)
    async def _generate_serve_batch(self, batch: list[Sequence]) -> list[Chunk]:
        """The ``@serve.batch`` baseline of the benchmark: fixed batches run to completion, whole text at once."""
        async with self.serve_batch_lock:
            await asyncio.to_thread(self.engine.run_batch, batch)
        self._record_step(len(batch), 0)
        return [joined(seq.chunks) for seq in batch]

    async def _sse(self, reply: dict, sequences: list[Sequence], choice, prompt_tokens: int, usage: bool):
        """Server-sent events: the choices' chunks as they come, errors as error events, usage last if asked."""
        merged: asyncio.Queue[tuple[int, Chunk | None]] = asyncio.Queue()

        async def pump(index: int, seq: Sequence) -> None:
            try:
                async for chunk in self._chunks(seq):
                    await merged.put((index, chunk))
            finally:
                await merged.put((index, None))

        tasks = [asyncio.create_task(pump(i, seq)) for i, seq in enumerate(sequences)]
        head = {
            **reply,
            "object": "text_completion" if reply["object"] == "text_completion" else "chat.completion.chunk",
        }
        start, open_streams, generated, started = time.perf_counter(), len(sequences), 0, set()
        try:
            while open_streams:
                index, chunk = await merged.get()
                if chunk is None:
                    open_streams -= 1
                elif chunk.finish_reason in ("error", "timeout"):
                    error = ErrorBody(error=ErrorDetail(message=chunk.text, type="server_error"))
                    yield f"data: {error.model_dump_json()}\n\n"
                else:
                    generated += chunk.tokens
                    first = index not in started
                    started.add(index)
                    body = choice(index, sequences[index], chunk.text, chunk.finish_reason, chunk.logprobs, first)
                    yield f"data: {json.dumps({**head, 'created': int(time.time()), 'choices': [body]})}\n\n"
            if usage:
                last = {
                    **head,
                    "created": int(time.time()),
                    "choices": [],
                    "usage": self._usage(prompt_tokens, generated),
                }
                yield f"data: {json.dumps(last)}\n\n"
            yield "data: [DONE]\n\n"
            self.latency.observe(time.perf_counter() - start)
        finally:
            for task in tasks:  # a client that went away: its generations stop and free their slots
                task.cancel()


def build_app(args: dict[str, Any]):
    """Serve application builder: ``args`` are ServeConfig fields."""
    cfg = serve_config_from_dict(args)
    return deployment_for(cfg).bind(cfg.to_dict())


def deployment_for(cfg: ServeConfig):
    gpu = cfg.resolved_device(torch.cuda.is_available()) == "cuda"
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
        # A replica that Serve stops (a new version deployed, a scale-down, a drained spot node) takes no new
        # requests and is killed once those in flight are done or this has passed: every one of them may run
        # to its own timeout (Serve's default of 20 s cut longer generations off with a 500).
        graceful_shutdown_timeout_s=cfg.request_timeout_s + SHUTDOWN_MARGIN_S,
        # How often a stopping replica looks whether its requests are done; it waits this long before the first
        # look too, so Serve's 2 s made every stop 2 s longer than its requests (python -m serve's too).
        graceful_shutdown_wait_loop_s=0.5,
    )
