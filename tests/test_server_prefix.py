"""`graft serve` over days, with the real `openai` client and the default model: the prefix cache's cached tokens
in OpenAI's usage field, /metrics in Prometheus' format, and the rough edges a new user meets (unknown paths, a
full queue, a port in use, a prompt past the context, a request cut off by SIGTERM)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import threading
import time
import urllib.error
import urllib.request

import pytest

from tests.test_server import GRAFT, KEY, MODEL, free_port, start, stop

openai = pytest.importorskip("openai")

pytestmark = pytest.mark.real_model
SYSTEM = "You are a careful assistant for an airline. " * 30  # a shared policy, a few hundred tokens


@pytest.fixture(scope="module")
def served():
    proc, url = start("--api-key", KEY, "--max-queue", "1")
    yield url, openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0, timeout=120)
    assert stop(proc) == 0


def ask(client, question: str, **kwargs):
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]
    settings = {"max_tokens": 12, "temperature": 0} | kwargs
    return client.chat.completions.create(model=MODEL, messages=messages, **settings)


def get(url: str, key: str | None = KEY) -> tuple[int, dict[str, str], str]:
    request = urllib.request.Request(url, headers={"Authorization": f"Bearer {key}"} if key else {})
    try:
        with urllib.request.urlopen(request, timeout=30) as r:
            return r.status, dict(r.headers), r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), e.read().decode()


def test_a_shared_system_prompt_is_cached_and_reported(served):
    url, client = served
    cold = ask(client, "Can I change my flight?")
    warm = ask(client, "Can I bring a dog?")
    assert cold.usage.prompt_tokens_details.cached_tokens == 0
    assert warm.usage.prompt_tokens_details.cached_tokens > 200  # the policy, not fed again
    again = ask(client, "Can I bring a dog?")
    assert again.usage.prompt_tokens_details.cached_tokens == again.usage.prompt_tokens - 1
    assert again.choices[0].message.content == warm.choices[0].message.content
    streamed = ask(client, "Can I bring a dog?", stream=True, stream_options={"include_usage": True})
    last = list(streamed)[-1]
    assert last.usage.prompt_tokens_details.cached_tokens == again.usage.prompt_tokens - 1
    status, headers, text = get(f"{url}/metrics")
    assert status == 200 and headers["content-type"].startswith("text/plain")
    values = dict(line.rsplit(" ", 1) for line in text.splitlines() if line and not line.startswith("#"))
    assert int(values["graft_prefix_cache_hits_total"]) >= 3
    assert int(values['graft_tokens_total{kind="cached"}']) >= warm.usage.prompt_tokens_details.cached_tokens
    ended = [int(values.get(f'graft_requests_total{{finish="{reason}"}}', 0)) for reason in ("length", "stop")]
    assert sum(ended) == 4
    assert values["graft_queue_waiting"] == "0" and int(values["graft_request_accepted_per_step_count"]) == 4
    assert get(f"{url}/metrics", key=None)[0] == 401


def test_unknown_paths_and_methods_answer_in_json(served):
    url, _ = served
    status, _, body = get(f"{url}/v2/nothing")
    assert status == 404 and json.loads(body)["error"]["code"] == "not_found"
    status, _, body = get(f"{url}/v1/chat/completions")
    assert status == 405 and "GET is not allowed" in json.loads(body)["error"]["message"]


def test_a_full_queue_says_when_to_retry_and_a_long_prompt_names_max_tokens(served):
    url, client = served
    stream = ask(client, "Write a long story.", stream=True, max_tokens=300)  # holds the worker
    next(iter(stream))
    queued = threading.Thread(target=ask, args=(client, "Hello?"))  # waits: the queue (--max-queue 1) is full
    queued.start()
    while json.loads(get(f"{url}/health")[2])["waiting"] < 1:
        time.sleep(0.05)
    with pytest.raises(openai.RateLimitError) as e:
        ask(client, "Hello?")
    assert int(e.value.response.headers["retry-after"]) >= 1
    stream.close()
    queued.join(60)
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "word " * 9000}],
                                       max_tokens=7)
    message = e.value.body["message"]
    assert "max_tokens 7" in message and "--" not in message and e.value.body["code"] == "context_length_exceeded"


def test_a_port_in_use_is_one_line_and_exit_2():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        out = subprocess.run([*GRAFT, "serve", "--port", str(port)], capture_output=True, text=True, timeout=120,
                             env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert out.returncode == 2
    assert out.stderr.strip().splitlines() == [f"graft: error: cannot listen on 127.0.0.1:{port}: the port is in use "
                                               "(give another with --port)"]


def long_chat(client, **kwargs):
    return client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Tell a long story."}],
                                          max_tokens=400, temperature=0, **kwargs)


@pytest.mark.parametrize("running", ["stream", "whole"])
def test_requests_cut_off_by_sigterm_say_so(running):
    """The running request and the one waiting behind it both end in an error that says why, never in an answer
    that passes for whole (finish_reason "length")."""
    proc, url = start("--no-response-cache", "--max-queue", "2")
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=60)
    outcomes: dict = {}

    def whole() -> None:
        try:
            outcomes["whole"] = long_chat(client).choices[0].finish_reason
        except openai.APIStatusError as e:
            outcomes["whole"] = (e.status_code, e.body["code"])

    def streamed() -> None:
        try:
            outcomes["stream"] = [c.choices[0].finish_reason for c in long_chat(client, stream=True) if c.choices][-1]
        except openai.APIError as e:
            outcomes["stream"] = ("error", e.body["code"])

    first, second = (streamed, whole) if running == "stream" else (whole, streamed)
    threads = [threading.Thread(target=first)]
    threads[0].start()
    while not json.load(urllib.request.urlopen(f"{url}/health"))["busy"]:
        time.sleep(0.1)
    threads.append(threading.Thread(target=second))
    threads[1].start()
    time.sleep(1)
    assert stop(proc) == 0
    [t.join(30) for t in threads]
    assert outcomes == {"whole": (503, "cancelled" if running == "whole" else "shutting_down"),
                        "stream": ("error", "cancelled" if running == "stream" else "shutting_down")}
