"""`graft serve` with the real `openai` client, the server in a subprocess on 127.0.0.1 and the default model: the
same text as `graft generate`, streams, errors as 4xx, concurrency behind the queue, disconnects and SIGTERM."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

import pytest

openai = pytest.importorskip("openai")

pytestmark = pytest.mark.real_model
MODEL = "smollm2-135m-instruct"
KEY = "sesame"
PROMPT = "Write a Python function that returns the square of a number."
GRAFT = [sys.executable, "-m", "graft_cli"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(*flags: str) -> tuple[subprocess.Popen, str]:
    port = free_port()
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.Popen([*GRAFT, "serve", "--port", str(port), *flags], env=env, stderr=subprocess.PIPE,
                            stdout=subprocess.DEVNULL, text=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 120
    while time.time() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"graft serve exited: {proc.stderr.read()}")
        try:
            urllib.request.urlopen(f"{url}/health", timeout=1)
            return proc, url
        except (urllib.error.URLError, ConnectionError, socket.timeout):
            time.sleep(0.3)
    proc.kill()
    raise AssertionError("graft serve did not start")


def stop(proc: subprocess.Popen) -> int:
    proc.send_signal(signal.SIGTERM)
    return proc.wait(timeout=30)


@pytest.fixture(scope="module")
def server():
    proc, url = start("--api-key", KEY, "--max-queue", "4")
    yield url
    assert stop(proc) == 0


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server}/v1", api_key=KEY, max_retries=0, timeout=120)


def generate(*flags: str) -> str:
    out = subprocess.run([*GRAFT, "generate", *flags], capture_output=True, text=True, check=True,
                         env=dict(os.environ, OMP_NUM_THREADS="1"))
    return out.stdout.removesuffix("\n")


def chat(client, content=PROMPT, **kwargs):
    return client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": content}], **kwargs)


def test_greedy_and_seeded_answers_are_graft_generates(client):
    greedy = chat(client, max_tokens=40, temperature=0)
    assert greedy.choices[0].message.content == generate(PROMPT, "-n", "40")
    assert greedy.usage.completion_tokens == 40 or greedy.choices[0].finish_reason == "stop"
    assert greedy.model_extra["graft"]["tau"] >= 1.0
    pieces = [c.choices[0].delta.content or "" for c in chat(client, max_tokens=40, temperature=0, stream=True)]
    assert "".join(pieces) == greedy.choices[0].message.content
    sampled = chat(client, max_tokens=30, temperature=0.8, seed=12)
    assert sampled.choices[0].message.content == generate(PROMPT, "-n", "30", "-t", "0.8", "--seed", "12")
    text = client.completions.create(model=MODEL, prompt="def square(x):", max_tokens=20, temperature=0)
    assert text.choices[0].text == generate("def square(x):", "--raw", "-n", "20")


def test_models_and_refusals(client, server):
    assert [m.id for m in client.models.list().data] == [MODEL]
    for kwargs, param in [(dict(n=2), "n"), (dict(logprobs=True), "logprobs"), (dict(model="gpt-9"), "model"),
                          (dict(max_tokens=0), "max_tokens"), (dict(temperature=5), "temperature")]:
        with pytest.raises(openai.BadRequestError) as e:
            chat(client, **({"max_tokens": 4} | kwargs)) if "model" not in kwargs else \
                client.chat.completions.create(messages=[{"role": "user", "content": "hi"}], max_tokens=4, **kwargs)
        assert e.value.status_code == 400 and e.value.body["param"] == param
    with pytest.raises(openai.BadRequestError) as e:
        chat(client, content="word " * 9000, max_tokens=4)
    assert "positions" in e.value.body["message"] and any(ch.isdigit() for ch in e.value.body["message"])
    status, body = post(server, b"{not json", key=KEY)
    assert status == 400 and body["error"]["type"] == "invalid_request_error"
    status, body = post(server, json.dumps({"model": MODEL, "messages": []}).encode(), key=KEY)
    assert status == 400 and body["error"]["param"] == "messages"
    status, _ = post(server, json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}).encode())
    assert status == 401
    assert json.load(urllib.request.urlopen(f"{server}/health"))["status"] == "ok"  # still serving


def post(server: str, data: bytes, key: str | None = None) -> tuple[int, dict]:
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
    request = urllib.request.Request(f"{server}/v1/chat/completions", data=data, headers=headers, method="POST")
    try:
        with urllib.request.urlopen(request, timeout=60) as r:
            return r.status, json.load(r)
    except urllib.error.HTTPError as e:
        return e.code, json.load(e)


def test_concurrent_clients_queue_and_overflow(client):
    expected = generate("Count to five.", "-n", "12")
    results: list = [None] * 5

    def ask(i: int) -> None:
        results[i] = chat(client, content="Count to five.", max_tokens=12, temperature=0).choices[0].message.content

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(5)]
    [t.start() for t in threads]
    [t.join(120) for t in threads]
    assert results == [expected] * 5
    codes: list[int] = []

    def flood() -> None:
        try:
            chat(client, max_tokens=24, temperature=0)
            codes.append(200)
        except openai.RateLimitError as e:
            codes.append(e.status_code)

    threads = [threading.Thread(target=flood) for _ in range(10)]
    [t.start() for t in threads]
    [t.join(180) for t in threads]
    assert len(codes) == 10 and 429 in codes and 200 in codes  # past --max-queue 4: refused at once, none hangs


def test_a_client_that_drops_frees_the_model(client, server):
    stream = chat(client, max_tokens=400, temperature=0, stream=True)
    next(iter(stream))
    stream.close()  # the client goes away mid-stream
    t0 = time.time()
    quick = chat(client, content="Say yes.", max_tokens=2, temperature=0)
    assert quick.choices[0].message.content and time.time() - t0 < 15  # not behind the 400-token generation
    assert not json.load(urllib.request.urlopen(f"{server}/health"))["busy"]


def test_sigterm_during_a_stream_exits_0():
    proc, url = start("--no-response-cache")
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=60)
    stream = chat(client, max_tokens=400, temperature=0, stream=True)
    next(iter(stream))
    assert stop(proc) == 0
    with pytest.raises((urllib.error.URLError, ConnectionError)):
        urllib.request.urlopen(f"{url}/health", timeout=2)


def test_the_same_request_twice_hits_the_response_cache(client):
    first = chat(client, content="List the first ten prime numbers, one per line.", max_tokens=48, temperature=0)
    second = chat(client, content="List the first ten prime numbers, one per line.", max_tokens=48, temperature=0)
    assert second.choices[0].message.content == first.choices[0].message.content
    tau1, tau2 = first.model_extra["graft"]["tau"], second.model_extra["graft"]["tau"]
    assert tau2 > 1.5 * tau1 and second.model_extra["graft"]["accepted"].get("responses", 0) > 0
