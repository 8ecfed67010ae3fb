"""Real HTTP to real Ray Serve apps on 127.0.0.1: completions, streaming, batching, bad input, keys, overload."""

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest
import requests
import yaml
from ray import serve

from serve.__main__ import main as serve_main
from serve.app import build_app
from serve.config import serve_config_from_dict
from tests.conftest import MEMORIZED_TEXT

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def server(ray_session, memorized_export):
    """Three apps on one Serve: the default one at /, one with an API key, one with room for one request."""
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    common = {"checkpoint": memorized_export, "cpus_per_replica": 0.25}
    serve.run(build_app({**common, "max_batch_size": 8, "max_ongoing_requests": 16}), name="main", route_prefix="/")
    serve.run(build_app({**common, "api_key": "s3cret"}), name="keyed", route_prefix="/keyed")
    tight = {"max_batch_size": 1, "max_ongoing_requests": 1, "max_queued_requests": 1, "retry_after_s": 2}
    serve.run(build_app({**common, **tight}), name="tight", route_prefix="/tight")
    yield f"http://127.0.0.1:{port}"
    serve.shutdown()


def complete(url: str, timeout: float = 60, **body) -> requests.Response:
    return requests.post(f"{url}/v1/completions", json=body, timeout=timeout)


def stream_text(response: requests.Response) -> tuple[str, str | None]:
    """Joined text and last finish_reason of an SSE completion stream, which must end in [DONE]."""
    events = [line[len("data: ") :] for line in response.iter_lines(decode_unicode=True) if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    choices = [json.loads(event)["choices"][0] for event in events[:-1]]
    return "".join(c["text"] for c in choices), choices[-1]["finish_reason"]


def test_completion_recites_the_model_text(server):
    reply = complete(server, prompt="Grüße aus", max_tokens=30, temperature=0)
    assert reply.status_code == 200, reply.text
    body = reply.json()
    text = body["choices"][0]["text"]
    # 30 bytes of the text after the prompt; the last character is cut in half: one replacement character.
    expected = (MEMORIZED_TEXT * 2).encode()[len("Grüße aus".encode()) :][:30].decode("utf-8", errors="replace")
    assert text == expected and text.endswith("\ufffd") and "€" in text
    assert body["choices"][0]["finish_reason"] == "length"
    assert body["model"] == "memorized" and body["usage"]["prompt_tokens"] == len("Grüße aus".encode())
    assert requests.get(f"{server}/v1/models", timeout=10).json()["data"][0]["id"] == "memorized"
    assert requests.get(f"{server}/health", timeout=10).status_code == 200
    assert requests.get(f"{server}/ready", timeout=10).json()["precision"] == "int8"


def test_streamed_text_equals_the_completion_with_multibyte_characters(server):
    for params in ({"temperature": 0}, {"temperature": 0.9, "seed": 3}, {"temperature": 0, "stop": ["☕"]}):
        whole = complete(server, prompt="Köln: 3", max_tokens=40, **params).json()["choices"][0]
        with requests.post(
            f"{server}/v1/completions",
            json={"prompt": "Köln: 3", "max_tokens": 40, "stream": True, **params},
            stream=True,
            timeout=60,
        ) as streamed:
            assert streamed.headers["content-type"].startswith("text/event-stream")
            assert stream_text(streamed) == (whole["text"], whole["finish_reason"])
        assert any(ord(ch) > 127 for ch in whole["text"]), whole["text"]
    assert whole["text"] == " € für " and whole["finish_reason"] == "stop"


def test_a_request_gets_the_same_text_alone_and_inside_a_batch(server):
    prompts = ["Grüße", "3 € für", "und 🚀. Grüße aus Köln", "K", "für ☕", "aus Köln: 3", "Gr", "🚀"] * 3
    greedy = {"max_tokens": 48, "temperature": 0}
    alone = [complete(server, prompt=p, **greedy).json()["choices"][0]["text"] for p in prompts[:8]]
    with ThreadPoolExecutor(len(prompts)) as pool:
        together = list(pool.map(lambda p: complete(server, prompt=p, **greedy).json()["choices"][0]["text"], prompts))
    assert together == alone * 3


BAD_REQUESTS = [
    ({}, "prompt"),
    ({"prompt": ""}, "prompt"),
    ({"prompt": 5}, "prompt"),
    ({"prompt": "x" * 200}, "prompt"),  # longer than the 96-token context
    ({"prompt": "hi", "max_tokens": "4"}, "max_tokens"),
    ({"prompt": "hi", "max_tokens": 0}, "max_tokens"),
    ({"prompt": "hi", "max_tokens": 95}, "max_tokens"),  # prompt + max_tokens > context
    ({"prompt": "hi", "temperature": -1}, "temperature"),
    ({"prompt": "hi", "top_p": 0}, "top_p"),
    ({"prompt": "hi", "stop": [1]}, "stop"),
    ({"prompt": "hi", "stop": ["a", "b", "c", "d", "e"]}, "stop"),
    ({"prompt": "hi", "seed": 1.5}, "seed"),
    ({"prompt": "hi", "stream": "yes"}, "stream"),
    ({"prompt": "hi", "frobnicate": 1}, "frobnicate"),
    ({"prompt": "hi", "model": "gpt-4"}, "model"),
]


@pytest.mark.parametrize(("body", "field"), BAD_REQUESTS, ids=[field for _, field in BAD_REQUESTS])
def test_bad_input_gets_a_4xx_that_names_the_field(server, body, field):
    reply = complete(server, **body)
    assert 400 <= reply.status_code < 500, reply.text
    assert field in reply.json()["error"]["message"]


def test_the_replica_survives_bad_input(server):
    garbage = requests.post(f"{server}/v1/completions", data=b"{not json", timeout=10)
    assert garbage.status_code == 400 and "JSON" in garbage.json()["error"]["message"]
    for body, _ in BAD_REQUESTS:
        complete(server, **body)
    assert complete(server, prompt="Grüße", max_tokens=5, temperature=0).json()["choices"][0]["text"] == " aus "


def test_api_key_is_required_when_configured(server):
    keyed = f"{server}/keyed"
    assert complete(keyed, prompt="Grüße", max_tokens=3).status_code == 401
    wrong = requests.post(
        f"{keyed}/v1/completions", json={"prompt": "Grüße"}, headers={"Authorization": "Bearer nope"}, timeout=10
    )
    assert wrong.status_code == 401
    # Bad input without a key is still a 401: the key is checked before anything else.
    assert complete(keyed, prompt=5).status_code == 401
    right = requests.post(
        f"{keyed}/v1/completions",
        json={"prompt": "Grüße", "max_tokens": 3},
        headers={"Authorization": "Bearer s3cret"},
        timeout=30,
    )
    assert right.status_code == 200
    assert requests.get(f"{keyed}/health", timeout=10).status_code == 200
    # The app without a key accepts anyone.
    assert complete(server, prompt="Grüße", max_tokens=3).status_code == 200


def test_overload_gets_429_with_retry_after_then_recovers(server):
    tight = f"{server}/tight"
    with ThreadPoolExecutor(12) as pool:
        replies = list(pool.map(lambda _: complete(tight, prompt="Grüße", max_tokens=80, temperature=0), range(12)))
    codes = [r.status_code for r in replies]
    assert 429 in codes and 200 in codes, codes
    assert set(codes) <= {200, 429}
    assert all(r.headers.get("retry-after") == "2" for r in replies if r.status_code == 429)
    assert complete(tight, prompt="Grüße", max_tokens=5, temperature=0).json()["choices"][0]["text"] == " aus "


def openai_roundtrip(base_url: str) -> None:
    """The official client, unchanged: list models, complete, stream; streamed text equals the completion."""
    client = openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0)
    assert [m.id for m in client.models.list()] == ["memorized"]
    whole = client.completions.create(model="memorized", prompt="Grüße aus", max_tokens=40, temperature=0)
    streamed = client.completions.create(
        model="memorized", prompt="Grüße aus", max_tokens=40, temperature=0, stream=True
    )
    assert "".join(event.choices[0].text for event in streamed) == whole.choices[0].text
    assert "🚀" in whole.choices[0].text or "☕" in whole.choices[0].text


def test_openai_client_end_to_end(server):
    openai_roundtrip(server)
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        openai.OpenAI(base_url=f"{server}/v1", api_key="x", max_retries=0).completions.create(
            model="memorized", prompt="hi", max_tokens=0
        )


def test_cli_rejects_a_bad_config_before_starting_ray(memorized_export, capsys):
    assert serve_main(["--checkpoint", "/nonexistent/run"]) == 2
    assert "checkpoint" in capsys.readouterr().err
    assert serve_main(["--checkpoint", memorized_export, "--set", "max_batch_size=0"]) == 2
    assert "max_batch_size" in capsys.readouterr().err


def test_python_m_serve_serves_the_openai_client(memorized_export):
    port = free_port()
    env = {**os.environ, "RAY_TMPDIR": tempfile.mkdtemp(prefix="/tmp/rws-")}
    env.pop("RAY_ADDRESS", None)
    command = [sys.executable, "-m", "serve", "--checkpoint", memorized_export, "--port", str(port)]
    process = subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.time() + 180
        while time.time() < deadline:
            assert process.poll() is None, process.stdout.read()
            try:
                if requests.get(f"http://127.0.0.1:{port}/ready", timeout=2).status_code == 200:
                    break
            except requests.RequestException:  # not listening yet, or the app not deployed yet
                pass
            time.sleep(1)
        openai_roundtrip(f"http://127.0.0.1:{port}")
    finally:
        process.send_signal(signal.SIGINT)
        try:
            process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            process.kill()


def test_cluster_deploy_config_is_a_valid_serve_config():
    from ray.serve.schema import ServeDeploySchema

    deploy = yaml.safe_load(open(os.path.join(REPO, "configs", "serve", "deploy.yaml")))
    ServeDeploySchema.model_validate(deploy)
    (app,) = deploy["applications"]
    assert app["import_path"] == "serve.app:build_app"
    serve_config_from_dict(app["args"])
