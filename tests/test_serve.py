"""Real HTTP to real Ray Serve apps on 127.0.0.1: completions, streaming, batching, bad input, keys, overload."""

import contextlib
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import openai
import psutil
import pytest
import requests
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis_jsonschema import from_schema
from ray import serve
from ray._common.test_utils import wait_for_condition

from serve.__main__ import check_can_listen, open_to_others_warning
from serve.__main__ import main as serve_main
from serve.app import build_app, deployment_for
from serve.config import serve_config_from_dict
from tests.conftest import MEMORIZED_TEXT
from train.process_group import free_port, free_ports
from train.schema import ConfigError

pytestmark = pytest.mark.cluster

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CHAT_TEMPLATE = "{% for message in messages %}{{ message['content'] }}{% endfor %}"


@pytest.fixture(scope="module")
def server(ray_session, memorized_export, tmp_path_factory):
    """Four apps on one Serve: the default one at /, one with an API key, one with room for one request,
    and one whose model declares a chat template."""
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    common = {"checkpoint": memorized_export, "cpus_per_replica": 0.25}
    serve.run(build_app({**common, "max_batch_size": 8, "max_ongoing_requests": 16}), name="main", route_prefix="/")
    # The key as an operator sets it: in the replica's environment, never in the (stored) config.
    keyed = deployment_for(serve_config_from_dict(common)).options(
        ray_actor_options={"num_cpus": 0.25, "runtime_env": {"env_vars": {"RAYWRIGHT_API_KEY": "s3cret"}}}
    )
    serve.run(keyed.bind(common), name="keyed", route_prefix="/keyed")
    tight = {"max_batch_size": 1, "max_ongoing_requests": 1, "max_queued_requests": 1, "retry_after_s": 2}
    serve.run(build_app({**common, **tight}), name="tight", route_prefix="/tight")
    # The same model with a chat template in its tokenizer config: the messages' contents, concatenated.
    chat_export = tmp_path_factory.mktemp("chat") / "memorized"  # served under the same name
    shutil.copytree(memorized_export, chat_export)
    tokenizer_config = json.loads((chat_export / "tokenizer_config.json").read_text())
    tokenizer_config["chat_template"] = CHAT_TEMPLATE
    (chat_export / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    serve.run(build_app({**common, "checkpoint": str(chat_export)}), name="chat", route_prefix="/chat")
    yield f"http://127.0.0.1:{port}"
    serve.shutdown()


def complete(url: str, timeout: float = 60, **body) -> requests.Response:
    return requests.post(f"{url}/v1/completions", json=body, timeout=timeout)


def ready(url: str) -> dict:
    """The app's /ready: its replica's load (sequences decoding, requests waiting, tokens generated) and model."""
    return requests.get(f"{url}/ready", timeout=10).json()


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
    assert ready(server)["precision"] == "int8"


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
    ({"prompt": []}, "prompt"),
    ({"prompt": ["Grüße", ""]}, "prompt"),
    ({"prompt": [[71], "Grüße"]}, "prompt"),
    ({"prompt": ["x"] * 33}, "prompt"),  # a batch of at most 32
    ({"prompt": ["hi", "x" * 200]}, "prompt.1: 200 tokens"),  # which prompt of the batch
    ({"prompt": [71, 257]}, "prompt"),  # past the byte-level vocabulary (0-256)
    ({"prompt": [True]}, "prompt"),
    ({"prompt": "hi", "max_tokens": "4"}, "max_tokens"),
    ({"prompt": "hi", "max_tokens": 0}, "max_tokens"),  # without echo: nothing to return
    ({"prompt": "hi", "max_tokens": -1, "echo": True}, "max_tokens"),
    ({"prompt": "hi", "max_tokens": 95}, "max_tokens"),  # prompt + max_tokens > context
    ({"prompt": "hi", "temperature": -1}, "temperature"),
    ({"prompt": "hi", "top_p": 0}, "top_p"),
    ({"prompt": "hi", "stop": [1]}, "stop"),
    ({"prompt": "hi", "stop": ["a", "b", "c", "d", "e"]}, "stop"),
    ({"prompt": "hi", "stop": ""}, "stop"),  # it would end every text at once
    ({"prompt": "hi", "stop": ["\n", ""]}, "stop.1: String should have at least 1 character"),
    ({"prompt": "hi", "seed": 1.5}, "seed"),
    ({"prompt": "hi", "seed": 2**64}, "seed"),
    ({"prompt": "hi", "seed": -1}, "seed"),
    ({"prompt": "hi", "n": 0}, "n"),
    ({"prompt": "hi", "logprobs": 6}, "logprobs"),
    ({"prompt": "hi", "presence_penalty": 2.5}, "presence_penalty"),
    ({"prompt": "hi", "stream_options": {"include_usage": 1}}, "stream_options"),
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


@pytest.fixture
def own_ray_env() -> Iterator[dict[str, str]]:
    """The environment of a ``python -m serve`` that starts a Ray of its own, in a temp dir removed afterwards
    (short: Ray's socket paths must stay under 108 bytes)."""
    temp_dir = tempfile.mkdtemp(prefix="/tmp/rws-")
    env = {key: value for key, value in os.environ.items() if key != "RAY_ADDRESS"}
    yield {**env, "RAY_TMPDIR": temp_dir}
    shutil.rmtree(temp_dir, ignore_errors=True)


def _names_of_processes_listening_on(port: int) -> set[str]:
    """A HAProxy reload (on a replica change) starts a new process and ends the old one: one that ended between
    the two looks is left out."""
    names = set()
    for connection in psutil.net_connections("tcp"):
        if connection.status == "LISTEN" and connection.laddr.port == port:
            assert connection.pid is not None, "cannot see who listens (not allowed to read their sockets)"
            with contextlib.suppress(psutil.NoSuchProcess):
                names.add(psutil.Process(connection.pid).name())
    return names


@pytest.mark.parametrize(
    ("ingress", "stopped_by"), [("proxy", "process"), ("haproxy", "process"), ("haproxy", "group")]
)
def test_python_m_serve_serves_the_openai_client(memorized_export, own_ray_env, ingress, stopped_by):
    """Behind Serve's proxy, and behind Ray's HAProxy, which then holds the port itself. Then a SIGTERM stops it
    promptly and leaves nothing listening on the port: sent to the process (``kill``, ``docker stop``), or to its
    whole process group, Ray's processes included (``kill -- -PGID``), behind HAProxy. Before, Serve's graceful
    shutdown waited out its 30 s timeout for either behind HAProxy (its replica stayed up 30 s for load balancers
    to deregister it), and the group's signal left HAProxy running, holding the port."""
    port, stats_port, metrics_port = free_ports(3)
    # HAProxy's stats and metrics ports are fixed unless set: free ones, so that nothing else on this machine matters.
    own_ray_env.update(RAY_SERVE_HAPROXY_STATS_PORT=str(stats_port), RAY_SERVE_HAPROXY_METRICS_PORT=str(metrics_port))
    command = [sys.executable, "-m", "serve", "--checkpoint", memorized_export, "--port", str(port)]
    command += ["--ingress", ingress]
    process = subprocess.Popen(
        command,
        cwd=REPO,
        env=own_ray_env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
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
        # Which process listens on the port says who the requests above went through. (HAProxy's own request
        # counts are no proof: a reload on a replica change resets them.)
        names: set[str] = set()

        def someone_listens() -> bool:
            names.update(_names_of_processes_listening_on(port))
            return bool(names)

        wait_for_condition(someone_listens, timeout=10)
        assert ("haproxy" in names) == (ingress == "haproxy"), names
    finally:
        stopping = time.monotonic()
        if stopped_by == "process":
            process.send_signal(signal.SIGTERM)  # stops it as Ctrl-C does
        else:
            os.killpg(process.pid, signal.SIGTERM)
        try:
            returncode = process.wait(timeout=60)
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)  # whatever it left in its group
    output = process.stdout.read()
    assert returncode == 0 and time.monotonic() - stopping < 25, (returncode, output[-3000:])
    check_can_listen("127.0.0.1", port, "--port")
    # No API key: said where the model is open to other machines (HAProxy's replica ports), not on 127.0.0.1 alone.
    assert ("no API key is set" in output) == (ingress == "haproxy"), output[-3000:]


def test_python_m_serve_stopped_while_its_app_deploys_shuts_down_cleanly(memorized_export, own_ray_env):
    """A SIGTERM (a container stopped, a rollout) before the server says it serves stops it as one sent later
    does. Before, one sent while serve.run waited for the app met Ray's own handler: a stack dump, exit 15."""
    port = free_port()
    command = [sys.executable, "-m", "serve", "--checkpoint", memorized_export, "--port", str(port)]
    process = subprocess.Popen(
        command, cwd=REPO, env=own_ray_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    timer = threading.Timer(180, process.kill)  # the line below never printed: fail, not hang
    timer.start()
    printed = []
    for line in process.stdout:
        printed.append(line)
        if "Deploying new version of Deployment" in line:  # Serve's controller, while serve.run waits
            process.send_signal(signal.SIGTERM)
    timer.cancel()
    output = "".join(printed)
    assert process.wait() == 0, output
    assert "SIGTERM received" not in output and "serving " not in output, output
    check_can_listen("127.0.0.1", port, "--port")  # nothing is left listening on the port


def test_cluster_deploy_config_is_a_valid_serve_config():
    from ray.serve.schema import ServeDeploySchema

    deploy = yaml.safe_load(open(os.path.join(REPO, "serve", "deploy.yaml")))
    ServeDeploySchema.model_validate(deploy)
    (app,) = deploy["applications"]
    assert app["import_path"] == "serve.app:build_app"
    serve_config_from_dict(app["args"])
    # Nothing in the stored config can set, or blank out, the API key.
    assert "RAYWRIGHT_API_KEY" not in json.dumps(app.get("runtime_env", {}))
    assert "api_key" not in app["args"]


def test_sampling_values_that_once_failed_the_batch_are_safe(server):
    """Each odd request runs beside a greedy one, whose text must not change."""
    for odd in ({"top_p": 5e-324}, {"temperature": 1e-39}, {"temperature": 2.0, "top_p": 5e-324, "seed": 2**63 - 1}):
        with ThreadPoolExecutor(2) as pool:
            odd_reply = pool.submit(complete, server, prompt="Köln", max_tokens=30, **odd)
            greedy = pool.submit(complete, server, prompt="Grüße", max_tokens=5, temperature=0)
        assert odd_reply.result().status_code == 200, (odd, odd_reply.result().text)
        assert greedy.result().json()["choices"][0]["text"] == " aus "
    # A plain-string stop of any length (OpenAI's limit of 4 is on the list).
    reply = complete(server, prompt="Grüße", max_tokens=40, temperature=0, stop=" 3 € für")
    assert reply.status_code == 200 and reply.json()["choices"][0]["text"] == " aus Köln:"


def test_openapi_documents_the_request_bodies(server):
    spec = requests.get(f"{server}/openapi.json", timeout=10).json()
    for path, model in (("/v1/completions", "CompletionRequest"), ("/v1/chat/completions", "ChatCompletionRequest")):
        body = spec["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]
        assert body["$ref"] == f"#/components/schemas/{model}"
    fields = spec["components"]["schemas"]["CompletionRequest"]["properties"]
    assert {"prompt", "n", "logprobs", "echo", "seed", "stream_options", "presence_penalty", "user"} <= set(fields)
    assert all(field.get("description") for name, field in fields.items() if name != "stream_options")
    assert requests.get(f"{server}/docs", timeout=10).status_code == 200


def test_schema_fuzz_finds_no_5xx_and_leaves_the_replica_serving(server):
    """Bodies drawn from the app's own /openapi.json, and mangled ones, against the live app."""
    spec = requests.get(f"{server}/openapi.json", timeout=10).json()
    schema = {**spec["components"]["schemas"]["CompletionRequest"], "components": spec["components"]}
    anything = st.recursive(
        st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20),
        lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3),
        max_leaves=5,
    )
    fields = sorted(schema["properties"])
    mangled = st.dictionaries(st.sampled_from(fields), anything, max_size=6)
    session = requests.Session()
    deadline = time.monotonic() + 120

    @settings(max_examples=150, deadline=None, database=None, derandomize=True, suppress_health_check=list(HealthCheck))
    @given(body=from_schema(schema) | mangled)
    def no_server_error(body: dict) -> None:
        if time.monotonic() > deadline:
            return
        body = {**body, "max_tokens": min(body["max_tokens"], 24)} if isinstance(body.get("max_tokens"), int) else body
        reply = session.post(
            f"{server}/v1/completions", data=json.dumps(body), timeout=60, headers={"content-type": "application/json"}
        )
        assert reply.status_code < 500, (body, reply.text)
        if reply.status_code == 200 and body.get("stream") is True:
            assert '"error"' not in reply.text, (body, reply.text)

    no_server_error()
    assert complete(server, prompt="Grüße", max_tokens=5, temperature=0).json()["choices"][0]["text"] == " aus "


def test_openai_client_uses_n_logprobs_echo_usage_penalties_and_user(server):
    client = openai.OpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0)
    many = client.completions.create(
        model="memorized", prompt="Grüße", max_tokens=8, temperature=1.0, seed=5, n=3, user="tester"
    )
    assert [c.index for c in many.choices] == [0, 1, 2]
    # Choice i is seeded seed + i: the same text as a request of its own with that seed.
    second = client.completions.create(model="memorized", prompt="Grüße", max_tokens=8, temperature=1.0, seed=6)
    assert second.choices[0].text == many.choices[1].text
    assert 3 <= many.usage.completion_tokens <= 24

    scored = client.completions.create(
        model="memorized", prompt="Grüße", max_tokens=8, temperature=0, logprobs=2, echo=True
    ).choices[0]
    assert scored.text == "Grüße aus Kö"
    logprobs = scored.logprobs
    prompt_tokens = len("Grüße".encode())
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == prompt_tokens + 8
    assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
    generated = list(zip(logprobs.token_logprobs, logprobs.top_logprobs, strict=True))[prompt_tokens:]
    # Greedy: every generated token is the most likely one, and each position lists two alternatives.
    assert all(len(top) == 2 and lp == pytest.approx(max(top.values())) for lp, top in generated)
    assert logprobs.text_offset[:3] == [0, 1, 2]

    events = list(
        client.completions.create(
            model="memorized",
            prompt="Grüße",
            max_tokens=8,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert events[-1].choices == [] and events[-1].usage.completion_tokens == 8
    assert "".join(e.choices[0].text for e in events[:-1]) == " aus Kö"

    plain = client.completions.create(model="memorized", prompt="3 € für", max_tokens=40, temperature=0)
    penalized = client.completions.create(
        model="memorized", prompt="3 € für", max_tokens=40, temperature=0, frequency_penalty=2.0, presence_penalty=2.0
    )
    assert penalized.choices[0].text != plain.choices[0].text


def test_a_batch_of_prompts_or_token_ids_gets_each_prompts_choices_in_order_as_it_would_alone(server):
    """OpenAI's prompt forms, as evaluation harnesses send them: texts, token ids, or a list of either; and
    prompts scored, not continued."""
    client = openai.OpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0)
    texts = ["Grüße", "3 € für", "🚀"]
    sampled = {"model": "memorized", "max_tokens": 8, "temperature": 1.0, "seed": 7, "n": 2}
    alone = [choice.text for text in texts for choice in client.completions.create(prompt=text, **sampled).choices]
    batch = client.completions.create(prompt=texts, **sampled)
    assert [c.index for c in batch.choices] == list(range(6))  # prompt p's choice i at p * n + i
    assert [c.text for c in batch.choices] == alone
    assert batch.usage.prompt_tokens == sum(len(text.encode()) for text in texts)
    # The byte-level tokenizer's ids are the UTF-8 bytes: the same prompts as token ids, alone and as a batch.
    ids = [list(text.encode()) for text in texts]
    assert [c.text for c in client.completions.create(prompt=ids, **sampled).choices] == alone
    echoed = client.completions.create(prompt=ids[0], **{**sampled, "n": 1, "echo": True}).choices[0].text
    assert echoed == texts[0] + alone[0]
    # Scoring, as harnesses measure log-likelihoods: max_tokens 0 with echo gives each prompt's logprobs alone.
    scoring = {"model": "memorized", "echo": True, "logprobs": 1, "temperature": 0}
    scored = client.completions.create(prompt=texts, max_tokens=0, **scoring)
    assert [c.text for c in scored.choices] == texts and scored.usage.completion_tokens == 0
    for text, choice in zip(texts, scored.choices, strict=True):
        generated = client.completions.create(prompt=text, max_tokens=2, **scoring).choices[0].logprobs
        assert choice.logprobs.token_logprobs == generated.token_logprobs[: len(text.encode())]

    greedy = complete(server, prompt=texts, max_tokens=8, temperature=0).json()["choices"]
    with requests.post(
        f"{server}/v1/completions",
        json={"prompt": texts, "max_tokens": 8, "temperature": 0, "stream": True},
        stream=True,
        timeout=60,
    ) as streamed:
        events = [line[6:] for line in streamed.iter_lines(decode_unicode=True) if line.startswith("data: ")]
    chunks = [choice for event in events[:-1] for choice in json.loads(event)["choices"]]
    assert ["".join(c["text"] for c in chunks if c["index"] == i) for i in range(3)] == [c["text"] for c in greedy]


def test_chat_completions_for_models_with_a_chat_template_only(server):
    reply = requests.post(
        f"{server}/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]}, timeout=10
    )
    assert reply.status_code == 400 and "declares no chat template" in reply.json()["error"]["message"]
    client = openai.OpenAI(base_url=f"{server}/chat/v1", api_key="unused", max_retries=0)
    messages = [{"role": "system", "content": "Grüße"}, {"role": "user", "content": " aus"}]
    answer = client.chat.completions.create(
        model="memorized", messages=messages, max_tokens=8, temperature=0, logprobs=True, top_logprobs=2
    )
    expected = complete(server, prompt="Grüße aus", max_tokens=8, temperature=0).json()["choices"][0]["text"]
    assert answer.choices[0].message.content == expected and answer.choices[0].message.role == "assistant"
    assert len(answer.choices[0].logprobs.content) == 8
    assert all(len(entry.top_logprobs) == 2 for entry in answer.choices[0].logprobs.content)
    streamed = client.chat.completions.create(
        model="memorized", messages=messages, max_tokens=8, temperature=0, stream=True
    )
    assert "".join(chunk.choices[0].delta.content or "" for chunk in streamed) == expected


def test_dropped_streams_free_their_slots_and_a_new_request_completes(server):
    before = ready(server)["generated_tokens"]

    def open_then_drop(_) -> None:
        with requests.post(
            f"{server}/v1/completions",
            json={"prompt": "K", "max_tokens": 94, "temperature": 0, "stream": True},
            stream=True,
            timeout=60,
        ) as reply:
            next(reply.iter_lines())  # the first token arrived: the sequence holds a slot; then the client goes

    with ThreadPoolExecutor(64) as pool:
        list(pool.map(open_then_drop, range(64)))
    started = time.monotonic()
    assert complete(server, prompt="Grüße", max_tokens=5, temperature=0).json()["choices"][0]["text"] == " aus "
    assert time.monotonic() - started < 10
    wait_for_condition(lambda: ready(server)["in_flight"] == 0, timeout=10)
    load = ready(server)
    # Had the dropped streams run to the end, they would have generated 64 x 94 tokens. What they generate before
    # their cancellations arrive (through Serve, ~0.1 s) grows with the decode speed: up to 35% of that here.
    assert load["generated_tokens"] - before < 64 * 94 / 2 and load["waiting"] == 0
    loop = load["decode_loop"]
    assert loop["prompts_prefilled"] >= 65 and 0 < loop["prefill_s"] < loop["step_s"] < loop["loop_s"]


def test_a_redeploy_lets_every_request_in_flight_on_the_replaced_replica_finish(server, memorized_export):
    """A new version of the app (a new checkpoint, a changed setting) replaces its replica; Serve stops the old one
    once its requests in flight are done, but for no longer than its graceful shutdown timeout, whose default of
    20 s cut off requests that raywright lets run for request_timeout_s. Here the old replica holds ~35 s of
    requests (it decodes one at a time) when the new version is deployed."""
    args = {"checkpoint": memorized_export, "cpus_per_replica": 0.25, "max_batch_size": 1, "max_ongoing_requests": 1024}
    serve.run(build_app(args), name="redeployed", route_prefix="/redeployed")
    url, body = f"{server}/redeployed", {"prompt": "K", "max_tokens": 90, "temperature": 0}
    alone = complete(url, **body).json()["choices"][0]["text"]
    started = time.monotonic()
    for _ in range(3):
        complete(url, **body)
    count = min(1000, math.ceil(35 / ((time.monotonic() - started) / 3)))

    def load() -> int:
        replica = ready(url)
        return replica["in_flight"] + replica["waiting"]

    with ThreadPoolExecutor(count) as pool:
        replies = [pool.submit(complete, url, timeout=300, **body) for _ in range(count)]
        wait_for_condition(lambda: load() >= count * 0.9, timeout=30)
        serve.run(build_app({**args, "request_timeout_s": 299.0}), name="redeployed", route_prefix="/redeployed")
        replies = [reply.result() for reply in replies]
    assert [reply.status_code for reply in replies] == [200] * count
    assert all(reply.json()["choices"][0]["text"] == alone for reply in replies)
    serve.delete("redeployed")


def test_a_replica_whose_engine_process_died_fails_fast_and_is_replaced(server, memorized_export):
    """The replica's requests get a 500 at once instead of waiting for a decode loop that is gone; Serve's health
    check replaces the replica, and the app serves the same text again."""
    args = {"checkpoint": memorized_export, "cpus_per_replica": 0.25}
    app = deployment_for(serve_config_from_dict(args)).options(health_check_period_s=1)
    serve.run(app.bind(args), name="fragile", route_prefix="/fragile")
    url, body = f"{server}/fragile", {"prompt": "Grüße aus", "max_tokens": 12, "temperature": 0}
    text, engine = complete(url, **body).json()["choices"][0]["text"], ready(url)["engine_pid"]
    os.kill(engine, signal.SIGKILL)
    failed = complete(url, timeout=10, **body)
    assert failed.status_code == 500 and failed.json()["error"]["message"] == "generation failed on the server"
    wait_for_condition(lambda: ready(url)["engine_pid"] not in (engine, None), timeout=120, retry_interval_ms=500)
    assert complete(url, **body).json()["choices"][0]["text"] == text
    serve.delete("fragile")


def test_body_size_is_limited_before_the_key_is_checked(server):
    keyed = f"{server}/keyed/v1/completions"
    big = requests.post(keyed, data=b"x" * 1_000_001, headers={"content-type": "application/json"}, timeout=10)
    assert big.status_code == 413 and "limit" in big.json()["error"]["message"]
    chunked = requests.post(keyed, data=iter([b'{"prompt": "hi"}']), timeout=10)
    assert chunked.status_code == 411


def test_the_api_key_comes_from_a_file_or_the_environment_never_the_config(tmp_path, monkeypatch, memorized_export):
    key_file = tmp_path / "key"
    key_file.write_text("from-file\n")
    monkeypatch.setenv("RAYWRIGHT_API_KEY", "from-env")
    base = {"checkpoint": memorized_export}
    assert serve_config_from_dict({**base, "api_key_file": str(key_file)}).resolved_api_key() == "from-file"
    assert serve_config_from_dict(base).resolved_api_key() == "from-env"
    key_file.write_text("\n")
    with pytest.raises(ValueError, match="api_key_file: .* is empty"):
        serve_config_from_dict({**base, "api_key_file": str(key_file)}).resolved_api_key()
    with pytest.raises(ConfigError, match="unknown key api_key"):
        serve_config_from_dict({**base, "api_key": "s3cret"})


def test_auto_precision_is_bf16_on_a_gpu_and_int8_on_a_cpu():
    auto = serve_config_from_dict({"checkpoint": "export"})
    assert (auto.resolved_precision("cuda"), auto.resolved_precision("cpu")) == ("bf16", "int8")
    assert serve_config_from_dict({"checkpoint": "export", "precision": "fp32"}).resolved_precision("cuda") == "fp32"


@pytest.mark.unit
def test_a_model_served_beyond_this_machine_without_an_api_key_is_warned_of():
    for loopback in ("127.0.0.1", "::1", "localhost"):
        assert open_to_others_warning(loopback, "proxy", "") is None
    everywhere = open_to_others_warning("0.0.0.0", "proxy", "")
    assert "--host 0.0.0.0 listens beyond this machine, and no API key" in everywhere
    assert "replica's port listens on all interfaces" in open_to_others_warning("127.0.0.1", "haproxy", "")
    assert open_to_others_warning("0.0.0.0", "haproxy", "s3cret") is None
