"""``laserlm serve`` against a real server process on 127.0.0.1 (started and stopped by the fixtures), driven by the
official ``openai`` client and by raw HTTP: outputs equal offline ``generate`` (an independent path: no scheduler,
no HTTP), every documented error status and body, a bounded load test of 16 concurrent streaming clients with one
killed mid-stream, and ``/metrics`` parsed with prometheus_client and checked against the requests sent."""

from __future__ import annotations

import json
import select
import socket
import threading
import time

import pytest
from server_helpers import ServerProcess, http, metrics

openai = pytest.importorskip("openai")

KEY = "sk-laserlm-test"
MODEL = "smollm2-135m"
ADAPTIVE = "adaptive:policy=confidence,threshold=0.9,patience=1"
NGRAM = "speculative:draft=ngram,loss_budget=off"  # token-only draft decisions: the stats must match offline
CTX = 512
BUDGET_MIB = 24  # 1024 pages of 16 positions x 30 layers: 16 requests of ~40 positions do not all fit at once


@pytest.fixture(scope="module")
def server():
    srv = ServerProcess(["--model", MODEL, "--weights", "fp32", "--threads", "1", "--ctx-size", str(CTX),
                         "--api-key", KEY, "--kv-budget", str(BUDGET_MIB), "--allow-mode", ADAPTIVE,
                         "--allow-mode", NGRAM, "--max-batch", "16"])
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=300)


AUTH = {"Authorization": f"Bearer {KEY}"}
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,"]


def test_openai_client_completion_chat_and_streaming(server, client, smol):
    r = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=12, temperature=0)
    ref = smol.generate(PROMPTS[0], max_new_tokens=12)
    assert r.choices[0].text == ref.text
    assert r.choices[0].finish_reason == ("length" if ref.finish_reason == "length" else "stop")
    assert r.usage.prompt_tokens == ref.prompt_tokens and r.usage.completion_tokens == len(ref.token_ids)
    timings = r.model_extra["timings"]
    assert timings["prompt_n"] == ref.prompt_tokens and timings["predicted_n"] == len(ref.token_ids)
    assert timings["layers_per_token"] == 30.0 and timings["draft_n"] == 0

    messages = [{"role": "user", "content": "What is the capital of France?"}]
    c = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=16, temperature=0)
    cref = smol.generate(messages, chat=True, max_new_tokens=16)
    assert c.choices[0].message.role == "assistant"
    assert c.choices[0].message.content == cref.text
    assert c.object == "chat.completion"

    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=16, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    assert all(ch.object == "chat.completion.chunk" for ch in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert text == cref.text
    finals = [ch for ch in chunks if ch.choices and ch.choices[0].finish_reason is not None]
    assert len(finals) == 1 and finals[0].model_extra["timings"]["predicted_n"] == len(cref.token_ids)
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(cref.token_ids)

    stream = list(client.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=10, temperature=0,
                                            stream=True))
    assert "".join(ch.choices[0].text for ch in stream) == smol.generate(PROMPTS[1], max_new_tokens=10).text


def test_raw_sse_format_and_done(server):
    body = {"model": MODEL, "prompt": PROMPTS[0], "max_tokens": 4, "temperature": 0, "stream": True}
    status, text = http("POST", server.url + "/v1/completions", body, AUTH)
    assert status == 200
    events = [ln for ln in text.split("\n\n") if ln]
    assert all(e.startswith("data: ") for e in events)
    assert events[-1] == "data: [DONE]"
    objs = [json.loads(e[6:]) for e in events[:-1]]
    assert {o["object"] for o in objs} == {"text_completion"} and objs[-1]["choices"][0]["finish_reason"] == "length"


@pytest.mark.parametrize("mode", ["full", ADAPTIVE, NGRAM])
def test_greedy_over_http_equals_offline_generate(server, client, smol, mode):
    for prompt in PROMPTS:
        extra = {} if mode == "full" else {"mode": mode}
        r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=20, temperature=0, extra_body=extra)
        ref = smol.generate(prompt, mode=mode, max_new_tokens=20)
        assert r.choices[0].text == ref.text, (mode, prompt)
        t = r.model_extra["timings"]
        if mode == ADAPTIVE:  # the adaptive mode's own layers per token and exit histogram
            assert t["layers_per_token"] == pytest.approx(ref.mean_layers_per_token, abs=1e-3)
            assert t["exit_layer_histogram"] == ref.extra["exit_layer_histogram"]
        if mode == NGRAM:
            spec = ref.extra["speculative"]
            assert (t["draft_n"], t["draft_n_accepted"]) == (spec["drafted"], spec["accepted"])


def test_stop_strings_and_sampling_seed(server, client, smol):
    r = client.completions.create(model=MODEL, prompt=PROMPTS[2], max_tokens=40, temperature=0, stop=[" the"])
    ref = smol.generate(PROMPTS[2], max_new_tokens=40, stop=[" the"])
    assert ref.finish_reason == "stop"  # the stop string does occur in this continuation
    assert r.choices[0].text == ref.text and r.choices[0].finish_reason == "stop"
    kw = {"model": MODEL, "prompt": PROMPTS[0], "max_tokens": 12, "temperature": 0.9, "top_p": 0.9, "seed": 7}
    a = client.completions.create(**kw, extra_body={"top_k": 40})
    b = client.completions.create(**kw, extra_body={"top_k": 40})
    ref = smol.generate(PROMPTS[0], max_new_tokens=12, temperature=0.9, top_p=0.9, top_k=40, seed=7)
    assert a.choices[0].text == b.choices[0].text == ref.text


def _error(status: int, body, expect_status: int, code=None, param=None):
    assert status == expect_status, body
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    assert body["error"]["message"]
    if code is not None:
        assert body["error"]["code"] == code, body
    if param is not None:
        assert body["error"]["param"] == param, body


@pytest.mark.parametrize("patch,param", [
    ({"temperature": -1}, "temperature"), ({"top_p": 1.5}, "top_p"), ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": "ten"}, "max_tokens"), ({"n": 17}, "n"), ({"n": 0}, "n"), ({"top_k": -5}, "top_k"), ({"top_k": 2**63}, "top_k"), ({"seed": -1}, "seed"),
    ({"stop": [""]}, "stop"), ({"prompt": ""}, "prompt"), ({"prompt": {"a": 1}}, "prompt"), ({"logprobs": 21}, "logprobs"), ({"echo": "yes"}, "echo"),
    ({"stream": "yes"}, "stream"), ({"model": None}, "model"), ({"prompt": [10**9]}, None),
    ({"seed": 2**64}, "seed"), ({"max_tokens": 4.5}, "max_tokens"), ({"prompt": ["a", 1]}, "prompt"),
    ({"temperature": 10**400}, "temperature"), ({"top_p": -10**400}, "top_p"), ({"prompt": [10**20]}, "prompt"),
    ({"prompt": [49152]}, "prompt"), ({"stream": True, "stream_options": {"include_usage": "no"}}, "stream_options"),
    ({"stream_options": {"include_usage": True}}, "stream_options"), ({"top_p": None, "temperature": "hot"},
                                                                      "temperature"),
    ({"n": True}, "n"), ({"temperature": 1e9}, "temperature"), ({"presence_penalty": 3}, "presence_penalty"),
    ({"frequency_penalty": -2.5}, "frequency_penalty"), ({"repetition_penalty": 0}, "repetition_penalty"), ({"temperature": 2.5}, "temperature"),
    ({"stop": ["x"] * 17}, "stop"), ({"stop": "y" * 257}, "stop"),
])
def test_invalid_parameters_are_400(server, patch, param):
    body = {"model": MODEL, "prompt": "Hello", "max_tokens": 4, **patch}
    _error(*http("POST", server.url + "/v1/completions", body, AUTH), 400, param=param)


def test_documented_error_statuses(server):
    url = server.url
    _error(*http("POST", url + "/v1/completions", raw=b"{not json", headers=AUTH), 400)
    _error(*http("POST", url + "/v1/completions", raw=b"[1, 2]", headers=AUTH), 400)
    _error(*http("POST", url + "/v1/completions", raw=b"[" * 100000 + b"]" * 100000, headers=AUTH), 400)
    _error(*http("POST", url + "/v1/completions", raw=b'{"model": "smollm2-135m", "prompt": "\\ud800 abc"}',
                 headers=AUTH), 400, param="prompt")
    for messages in ([], [{"role": "user"}], [{"role": "robot", "content": "hi"}], "hi",
                     [{"role": "user", "content": [{"type": "image_url", "image_url": "x"}]}]):
        _error(*http("POST", url + "/v1/chat/completions", {"model": MODEL, "messages": messages}, AUTH), 400,
               param="messages")
    body = {"model": MODEL, "prompt": "Hello", "max_tokens": 4}
    _error(*http("POST", url + "/v1/completions", {**body, "mode": "adaptive:policy=confidence,threshold=0.5"},
                 AUTH), 400, "mode_not_allowed", "mode")
    _error(*http("POST", url + "/v1/completions", {**body, "prompt": "word " * (CTX + 10)}, AUTH), 400,
           "context_length_exceeded")
    _error(*http("POST", url + "/v1/completions", {**body, "max_tokens": CTX}, AUTH), 400, "context_length_exceeded")
    _error(*http("POST", url + "/v1/completions", body), 401, "invalid_api_key")
    _error(*http("POST", url + "/v1/completions", body, {"Authorization": "Bearer wrong"}), 401, "invalid_api_key")
    _error(*http("GET", url + "/v1/models"), 401)
    _error(*http("POST", url + "/v1/completions", {**body, "model": "gpt-4"}, AUTH), 404, "model_not_found", "model")
    _error(*http("GET", url + "/v1/nothing-here", headers=AUTH), 404)
    status, models = http("GET", url + "/v1/models", headers=AUTH)
    assert status == 200 and [m["id"] for m in models["data"]] == [MODEL]
    assert models["data"][0]["modes"] == ["full", ADAPTIVE, NGRAM]
    assert http("GET", url + "/health")[0] == 200  # still up after all of it
    # the official client maps the statuses to its exception types
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=url + "/v1", api_key="wrong", max_retries=0).models.list()
    c = openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0)
    with pytest.raises(openai.NotFoundError):
        c.completions.create(model="nope", prompt="Hi", max_tokens=2)
    with pytest.raises(openai.BadRequestError):
        c.completions.create(model=MODEL, prompt="Hi", max_tokens=2, temperature=-3)


def test_hostile_bodies_are_refused_before_any_work(server):
    """Defects of the hostile-input run (issue 38): each answered with its 4xx, the server still serving after."""
    url = server.url
    # a 5,000-digit integer: Python's int-string limit inside the JSON parser is a 400, not a 500
    raw = b'{"model": "smollm2-135m", "prompt": "Hi", "max_tokens": 1' + b"0" * 5000 + b"}"
    _error(*http("POST", url + "/v1/completions", raw=raw, headers=AUTH), 400)
    # 20,000 stop strings of 64 characters (1.3 MB): refused at validation, before a token is generated
    before = metrics(url)
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 8,
            "stop": ["s" * 64] * 20_000}
    _error(*http("POST", url + "/v1/chat/completions", body, AUTH), 400, param="stop")
    after = metrics(url)
    assert after["laserlm:generation_tokens_total"] == before["laserlm:generation_tokens_total"]
    assert after.get("laserlm:request_errors_total{code=,status=400,type=invalid_request_error}", 0) == \
        before.get("laserlm:request_errors_total{code=,status=400,type=invalid_request_error}", 0) + 1
    # the documented limits themselves are accepted
    ok = http("POST", url + "/v1/completions", {"model": MODEL, "prompt": "Hi", "max_tokens": 2,
                                                 "stop": ["z" * 256] + ["q"] * 15, "temperature": 2}, AUTH)
    assert ok[0] == 200, ok
    # an assistant turn with content null (a tool-call history) is valid OpenAI input
    msgs = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": None},
            {"role": "user", "content": "Hello?"}]
    ok = http("POST", url + "/v1/chat/completions", {"model": MODEL, "messages": msgs, "max_tokens": 2}, AUTH)
    assert ok[0] == 200, ok
    _error(*http("POST", url + "/v1/chat/completions",
                 {"model": MODEL, "messages": [{"role": "user", "content": None}]}, AUTH), 400, param="messages")
    # a text prompt too long for the context even at the tokenizer's longest piece: refused untokenized
    status, err = http("POST", url + "/v1/completions", {"model": MODEL, "prompt": "a" * 3_000_000}, AUTH)
    _error(status, err, 400, "context_length_exceeded", "prompt")
    assert "characters" in err["error"]["message"]
    # /docs is off by default; /health names a replica, not a pid
    assert http("GET", url + "/docs")[0] == 404 and http("GET", url + "/openapi.json")[0] == 404
    health = http("GET", url + "/health")[1]
    assert health["status"] == "ok" and "pid" not in health and len(health["replica"]) == 16


def _raw_request(url: str, head: bytes, body: bytes = b"", timeout: float = 20.0) -> bytes:
    """Send ``head`` then ``body`` in 64 KiB pieces, stopping as soon as the server answers, and return the answer
    (the body may be incomplete on purpose: a server that waited for the rest would time out here)."""
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=timeout) as s:
        s.sendall(head)
        for i in range(0, len(body), 65536):
            if select.select([s], [], [], 0)[0]:
                break
            try:
                s.sendall(body[i:i + 65536])
            except (BrokenPipeError, ConnectionResetError):
                break
        got = b""
        while True:
            try:
                chunk = s.recv(65536)
            except (TimeoutError, ConnectionResetError):
                break
            if not chunk:
                break
            got += chunk
            if b"\r\n\r\n" in got and got.rstrip().endswith(b"}"):
                break
        return got


def test_oversized_body_is_413_without_reading_it(server):
    """A body over --max-body-bytes (4 MiB) is 413. Structural checks: a Content-Length over the limit is answered
    while the body has not been sent at all, and a chunked body is answered once the limit is passed while its
    end has not been sent (a handler that read on would wait for the rest and time out)."""
    head = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            + f"Authorization: Bearer {KEY}\r\n".encode())
    got = _raw_request(server.url, head + b"Content-Length: 5000000\r\n\r\n", b'{"model": ')
    assert got.startswith(b"HTTP/1.1 413"), got[:200]
    assert b"request_too_large" in got
    chunk = b"x" * 65536
    body = b"".join(b"%x\r\n" % len(chunk) + chunk + b"\r\n" for _ in range(70))  # 4.4 MiB, never terminated
    got = _raw_request(server.url, head + b"Transfer-Encoding: chunked\r\n\r\n", body)
    assert got.startswith(b"HTTP/1.1 413"), got[:200]
    assert http("GET", server.url + "/health")[0] == 200


def test_metrics_parse_and_match_the_requests_sent(server, client):
    before = metrics(server.url)
    usages = []
    for i in range(3):
        r = client.completions.create(model=MODEL, prompt=PROMPTS[i], max_tokens=5 + i, temperature=0)
        usages.append(r.usage)
    http("POST", server.url + "/v1/completions", {"model": MODEL, "prompt": "Hi", "temperature": -1}, AUTH)
    after = metrics(server.url)

    def delta(name):
        return after.get(name, 0.0) - before.get(name, 0.0)

    assert delta("laserlm:prompt_tokens_total") == sum(u.prompt_tokens for u in usages)
    assert delta("laserlm:generation_tokens_total") == sum(u.completion_tokens for u in usages)
    assert delta("laserlm:time_to_first_token_seconds_count") == 3
    assert delta("laserlm:e2e_request_latency_seconds_count") == 3
    assert delta("laserlm:layers_per_token_count") == sum(u.completion_tokens for u in usages)
    assert sum(delta(k) for k in after if k.startswith("laserlm:request_success_total")) == 3
    assert sum(delta(k) for k in after if k.startswith("laserlm:request_errors_total")) == 1
    for name in ("laserlm:num_requests_running", "laserlm:num_requests_waiting", "laserlm:kv_cache_usage_perc"):
        assert name in after


def _stream_tokens(url: str, prompt: str, max_tokens: int, out: dict, key: int) -> None:
    c = openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0, timeout=600)
    pieces, usage, finish = [], None, None
    for ch in c.completions.create(model=MODEL, prompt=prompt, max_tokens=max_tokens, temperature=0, stream=True,
                                   stream_options={"include_usage": True}, extra_body={"ignore_eos": True}):
        if ch.choices:
            pieces.append(ch.choices[0].text)
            finish = ch.choices[0].finish_reason or finish
        if ch.usage is not None:
            usage = ch.usage
    out[key] = ("".join(pieces), usage, finish)


def _kill_mid_stream(url: str, seen: threading.Event) -> None:
    """A client that reads a few events of a long stream, then drops the connection."""
    body = json.dumps({"model": MODEL, "prompt": "Count to one hundred:", "max_tokens": 400, "temperature": 0,
                       "stream": True, "ignore_eos": True}).encode()
    host, port = url.removeprefix("http://").split(":")
    s = socket.create_connection((host, int(port)))
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
              + f"Authorization: Bearer {KEY}\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body)
    got = b""
    while got.count(b"data: ") < 4:
        got += s.recv(4096)
    seen.set()
    s.close()


def test_16_concurrent_streams_one_killed(server, smol):
    """16 streaming clients (4 prompts x 4 lengths) plus one killed mid-stream: each gets exactly its tokens and
    the offline greedy text of its prompt, the pool never holds more than its budget, and the killed client's pages
    are freed (usage back to 0 once everything finished)."""
    prompts = [PROMPTS[0], PROMPTS[1], PROMPTS[2], "The three primary colors are"]
    lengths = [8, 12, 16, 20]
    refs = {(p, n): smol.generate(p, max_new_tokens=n, ignore_eos=True).text for p in prompts for n in lengths}
    before = metrics(server.url)
    out: dict = {}
    seen = threading.Event()
    threads = [threading.Thread(target=_stream_tokens, args=(server.url, p, n, out, (p, n)))
               for p in prompts for n in lengths]
    killer = threading.Thread(target=_kill_mid_stream, args=(server.url, seen))
    killer.start()
    for t in threads:
        t.start()
    t0 = time.monotonic()
    for t in threads + [killer]:
        t.join(timeout=max(1.0, 600 - (time.monotonic() - t0)))
    assert seen.is_set() and not any(t.is_alive() for t in threads)
    assert len(out) == 16
    for (p, n), (text, usage, finish) in out.items():
        assert usage.completion_tokens == n and finish == "length", (p, n)
        assert text == refs[(p, n)], (p, n)  # nothing lost, duplicated or mixed up between requests
    deadline = time.monotonic() + 60
    while True:  # the killed request is cancelled at the engine's next iteration
        m = metrics(server.url)
        if m["laserlm:num_requests_running"] == 0 and m["laserlm:kv_cache_usage_perc"] == 0:
            break
        assert time.monotonic() < deadline, "the killed client's request still holds pages"
        time.sleep(0.5)
    assert m["laserlm:kv_cache_reserved_perc"] == 0
    assert 0 < m["laserlm:kv_cache_peak_usage_perc"] <= 1.0
    assert m["laserlm:kv_cache_capacity_bytes"] <= BUDGET_MIB * 2**20
    aborted = m.get("laserlm:request_success_total{finished_reason=abort}", 0) - before.get(
        "laserlm:request_success_total{finished_reason=abort}", 0)
    assert aborted == 1
    assert http("GET", server.url + "/health")[0] == 200


@pytest.fixture(scope="module")
def small_server():
    """One request at a time, one waiting, a 512-token KV budget."""
    srv = ServerProcess(["--model", MODEL, "--weights", "fp32", "--threads", "1", "--ctx-size", "1024",
                         "--kv-budget", "512t", "--max-batch", "1", "--max-queue", "1"])
    yield srv
    srv.stop()


def test_queue_full_is_429_and_too_big_is_400(small_server):
    url = small_server.url
    body = {"model": MODEL, "prompt": "Hello", "max_tokens": 600}
    _error(*http("POST", url + "/v1/completions", body), 400, "kv_budget_exceeded")
    # more prompts than run + wait at once: never servable, so 400 (not 429, which clients retry)
    _error(*http("POST", url + "/v1/completions", {**body, "prompt": ["a", "b", "c"], "max_tokens": 2}), 400,
           param="prompt")
    # a chat request without max_tokens gets what the pool can hold (512 tokens here), not a refusal
    status, out = http("POST", url + "/v1/chat/completions", {"model": MODEL, "temperature": 0,
                                                              "messages": [{"role": "user", "content": "Hi"}]})
    assert status == 200, out
    assert out["usage"]["prompt_tokens"] + out["usage"]["completion_tokens"] <= 512
    results = {}

    def run(i, n):
        results[i] = http("POST", url + "/v1/completions", {"model": MODEL, "prompt": "Hello there", "max_tokens": n,
                                                           "temperature": 0, "ignore_eos": True})

    a = threading.Thread(target=run, args=("a", 120))
    a.start()
    deadline = time.monotonic() + 60
    while metrics(url)["laserlm:num_requests_running"] < 1:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    b = threading.Thread(target=run, args=("b", 4))
    b.start()
    while metrics(url)["laserlm:num_requests_waiting"] < 1:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    status, err = http("POST", url + "/v1/completions", {"model": MODEL, "prompt": "Hi", "max_tokens": 2})
    _error(status, err, 429, "queue_full")
    a.join(300)
    b.join(300)
    assert results["a"][0] == 200 and results["a"][1]["usage"]["completion_tokens"] == 120
    assert results["b"][0] == 200 and results["b"][1]["usage"]["completion_tokens"] == 4


def test_serve_refuses_bad_flags_before_loading(capsys):
    from laserlm.cli import main

    for argv, msg in [(["--port", "70000"], "--port"), (["--attention", "sparse"], "dense attention"),
                      (["--kv-budget", "lots"], "budget"), (["--max-batch", "0"], "max_batch"),
                      (["--replicas", "0"], "--replicas"), (["--eviction", "fifo"], "eviction")]:
        assert main(["serve", *argv]) == 2
        assert msg in capsys.readouterr().err


def test_sigterm_drains_then_ends_every_stream_with_an_answer():
    """SIGTERM with 8 streams in flight: the server stops admitting, lets them run --shutdown-timeout (2 s) more,
    then sends each unfinished stream an error event and ``[DONE]``; no client sees a stream cut short."""
    import signal
    import urllib.request

    srv = ServerProcess(["--model", MODEL, "--weights", "fp32", "--threads", "1", "--ctx-size", "1024",
                         "--max-batch", "8", "--shutdown-timeout", "2"])
    events: dict[int, list] = {}
    started = threading.Barrier(9, timeout=120)

    def stream(i: int) -> None:
        body = json.dumps({"model": MODEL, "prompt": f"Story number {i}:", "max_tokens": 900, "temperature": 0,
                           "stream": True, "ignore_eos": True}).encode()
        req = urllib.request.Request(srv.url + "/v1/completions", data=body, method="POST",
                                     headers={"Content-Type": "application/json"})
        got = events.setdefault(i, [])
        with urllib.request.urlopen(req, timeout=120) as r:
            for line in r:
                line = line.decode().strip()
                if line.startswith("data: "):
                    got.append(line[6:])
                    if len(got) == 3:
                        started.wait()
    threads = [threading.Thread(target=stream, args=(i,)) for i in range(8)]
    try:
        for t in threads:
            t.start()
        started.wait()
        srv.proc.send_signal(signal.SIGTERM)
        t0 = time.monotonic()
        for t in threads:
            t.join(60)
        assert srv.proc.wait(60) in (0, -signal.SIGTERM)  # uvicorn re-raises the signal it handled
        assert time.monotonic() - t0 < 30
    finally:
        srv.stop()
    for i in range(8):
        got = events[i]
        assert got[-1] == "[DONE]", (i, got[-3:])
        last = json.loads(got[-2])
        # 900 tokens cannot finish in 2 s on one thread: each stream ends with the shutdown error, not a cut
        assert last.get("error", {}).get("code") == "server_shutting_down", (i, last)


def test_greedy_streams_do_not_depend_on_the_other_requests():
    """Batch invariance (issue 38): on the default (native) weights, 24 concurrent greedy chat streams, in 3 runs
    with different arrival orders, each equal the same request made alone: the multi-row kernels compute every row
    as alone and prompts are prefilled in chunks whose arithmetic does not depend on their size."""
    import random

    srv = ServerProcess(["--model", MODEL, "--threads", "1", "--ctx-size", "1024", "--max-batch", "16",
                         "--prefill-chunk", "64"])
    try:
        topics = ["the sea", "a dragon", "tea", "the moon", "bicycles", "rain", "a library", "winter", "a robot",
                  "bread", "the desert", "a violin"]
        prompts = [f"Write two sentences about {t}." for t in topics] + [f"What is {t}? Answer briefly." for t in topics]

        def ask(p: str) -> str:
            status, out = http("POST", srv.url + "/v1/chat/completions",
                               {"model": MODEL, "messages": [{"role": "user", "content": p}], "max_tokens": 32,
                                "temperature": 0, "stream": False})
            assert status == 200, out
            return out["choices"][0]["message"]["content"]

        solo = [ask(p) for p in prompts]
        for run in range(3):
            order = list(range(len(prompts)))
            random.Random(run).shuffle(order)
            got: dict[int, str] = {}

            def one(i: int, delay: float) -> None:
                time.sleep(delay)
                got[i] = ask(prompts[i])
            threads = [threading.Thread(target=one, args=(i, 0.05 * k * run)) for k, i in enumerate(order)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(300)
            diff = [i for i in range(len(prompts)) if got.get(i) != solo[i]]
            assert not diff, (run, [(prompts[i], solo[i], got.get(i)) for i in diff[:3]])
    finally:
        srv.stop()


@pytest.mark.parametrize("context,continuation", [
    ("Question: What is the capital of France?\nAnswer:", " Paris"),
    # the one generated token is EOS: it must still be reported, or lm-eval's [ctxlen:-1] drops the last token of "Yes."
    ("<|im_start|>user\nSay yes.<|im_end|>\n<|im_start|>assistant\n", "Yes."),
])
def test_echo_logprobs_score_the_prompt_as_transformers_and_lm_eval_read_them(server, smol_ref, context,
                                                                               continuation):
    """``echo`` + ``logprobs`` + ``max_tokens`` 0/1 (lm-evaluation-harness's ``local-completions`` log-likelihood
    request): the prompt's token log-probabilities equal the unmodified transformers model's log-softmax, and
    lm-eval's own parser reads the continuation's log-likelihood and greediness from the response."""
    import torch
    from lm_eval.models.openai_completions import LocalCompletionsAPI

    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smol_ref.name_or_path)
    ctx_ids = tok(context)["input_ids"]
    ids = ctx_ids + tok(continuation, add_special_tokens=False)["input_ids"]
    with torch.no_grad():
        ref = torch.log_softmax(smol_ref(torch.tensor([ids])).logits[0].double(), -1)
    want = [float(ref[i - 1, ids[i]]) for i in range(1, len(ids))]
    for max_tokens in (0, 1):
        status, out = http("POST", server.url + "/v1/completions",
                           {"model": MODEL, "prompt": ids, "max_tokens": max_tokens, "logprobs": 1, "echo": True,
                            "temperature": 0}, AUTH)
        assert status == 200, out
        lp = out["choices"][0]["logprobs"]
        assert len(lp["tokens"]) == len(ids) + max_tokens
        assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
        got = lp["token_logprobs"][1:len(ids)]
        assert max(abs(a - b) for a, b in zip(got, want)) < 1e-3, (got, want)
        assert out["choices"][0]["text"].startswith(tok.decode(ids))
        assert lp["text_offset"] == sorted(lp["text_offset"]) and lp["text_offset"][0] == 0
        for top in lp["top_logprobs"][1:]:
            assert 1 <= len(top) <= 2
        if max_tokens == 1:  # lm-eval's parser: the continuation's summed log-prob and whether it is greedy
            (ll, greedy), = LocalCompletionsAPI.parse_logprobs(out, tokens=[ids], ctxlens=[len(ctx_ids)])
            assert abs(ll - sum(want[len(ctx_ids) - 1:])) < 1e-3
            argmax = [int(ref[i - 1].argmax()) for i in range(len(ctx_ids), len(ids))]
            assert greedy == (argmax == ids[len(ctx_ids):])


def test_logprobs_of_generated_tokens_chat_and_completions(server, client, smol_ref):
    """The official client gets ``logprobs`` on chat (``top_logprobs``) and completions; greedy tokens are their
    distribution's argmax, and each value is the transformers model's log-softmax of the sequence."""
    import torch

    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Name a color."}],
                                       max_tokens=6, temperature=0, logprobs=True, top_logprobs=3)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    for e in content:
        assert len(e.top_logprobs) == 3 and e.top_logprobs[0].token == e.token
        assert e.top_logprobs[0].logprob == e.logprob and bytes(e.bytes).decode() == e.token
    c = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=5, temperature=0, logprobs=2)
    lp = c.choices[0].logprobs
    assert "".join(lp.tokens) == c.choices[0].text and len(lp.token_logprobs) == 5
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smol_ref.name_or_path)
    ids = tok(PROMPTS[0])["input_ids"]
    gen = tok(c.choices[0].text, add_special_tokens=False)["input_ids"]
    if len(gen) == 5:  # the text re-tokenizes to the same 5 tokens (true for this prompt; checked, not assumed)
        with torch.no_grad():
            ref = torch.log_softmax(smol_ref(torch.tensor([ids + gen])).logits[0].double(), -1)
        want = [float(ref[len(ids) + k - 1, gen[k]]) for k in range(5)]
        assert max(abs(a - b) for a, b in zip(lp.token_logprobs, want)) < 1e-3
    else:
        pytest.fail(f"re-tokenized completion has {len(gen)} tokens")
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL, prompt="Hi", max_tokens=2, logprobs=1, stream=True)
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL, prompt="Hi", max_tokens=0)


def test_n_choices_with_documented_seeds_and_penalties(server, client, smol):
    """``n = 3`` returns 3 choices; with a seed, choice ``j`` equals the same request with ``n = 1`` and seed
    ``seed + j`` (as documented). Penalties reach the sampler (a looping prompt changes under them, offline's
    output with the same penalties is the reference) and are refused with a speculative mode."""
    kw = dict(model=MODEL, prompt=PROMPTS[2], max_tokens=8, temperature=0.9, seed=11)
    r = client.completions.create(n=3, **kw)
    assert [c.index for c in r.choices] == [0, 1, 2] and r.usage.completion_tokens == 3 * 8
    for j, c in enumerate(r.choices):
        one = client.completions.create(**{**kw, "seed": 11 + j})
        assert c.text == one.choices[0].text
    assert len({c.text for c in r.choices}) > 1  # the seeds differ, so (almost surely) the samples do
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=4,
                                          temperature=0, n=2)
    assert len(chat.choices) == 2 and chat.choices[0].message.content == chat.choices[1].message.content
    loop = "I am a wolf, I am a wolf, I am a wolf,"
    plain = client.completions.create(model=MODEL, prompt=loop, max_tokens=12, temperature=0)
    pen = client.completions.create(model=MODEL, prompt=loop, max_tokens=12, temperature=0, frequency_penalty=1.0,
                                    presence_penalty=0.5, extra_body={"repetition_penalty": 1.2})
    assert pen.choices[0].text != plain.choices[0].text
    ref = smol.generate(loop, max_new_tokens=12, frequency_penalty=1.0, presence_penalty=0.5, repetition_penalty=1.2)
    assert pen.choices[0].text == ref.text
    with pytest.raises(openai.BadRequestError, match="penalt"):
        client.completions.create(model=MODEL, prompt=loop, max_tokens=4, presence_penalty=0.5,
                                  extra_body={"mode": NGRAM})


SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "age", "city"],
          "properties": {"name": {"type": "string", "maxLength": 24}, "age": {"type": "integer", "minimum": 0,
                                                                              "maximum": 150},
                         "city": {"type": "string", "maxLength": 24}}}


def test_json_schema_output_parses_and_validates_on_20_prompts(server, client):
    """``response_format`` ``json_schema``: 20 chat prompts (greedy and sampled), every answer parses and validates
    against the schema (checked by the ``jsonschema`` library, an independent validator); ``json_object`` gives a
    JSON object; an unsupported schema is a 400 naming the feature; speculative modes refuse it."""
    import jsonschema

    people = ["a baker", "a pilot", "a poet", "a nurse", "a farmer", "a chess player", "a sailor", "a teacher",
              "a painter", "a carpenter"]
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA}}
    for k, who in enumerate(people * 2):
        r = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": f"Invent {who}. Give name, age and city as JSON."}],
            max_tokens=80, temperature=0 if k < 10 else 0.8, seed=k, response_format=fmt)
        assert r.choices[0].finish_reason == "stop", r.choices[0]
        jsonschema.validate(json.loads(r.choices[0].message.content), SCHEMA)
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "A fruit as JSON."}],
                                       max_tokens=60, temperature=0, response_format={"type": "json_object"})
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(r.choices[0].message.content), dict)
    else:  # cut by max_tokens: still a prefix of a JSON object
        assert r.choices[0].message.content.startswith("{")
    bad_fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object", "properties": {
        "a": {"type": "string", "format": "no-such-format"}}}}}
    with pytest.raises(openai.BadRequestError, match="no-such-format"):
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=4,
                                       response_format=bad_fmt)
    with pytest.raises(openai.BadRequestError, match="response_format"):
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=4,
                                       response_format=fmt, extra_body={"mode": NGRAM})


def test_logprobs_of_multibyte_text_and_stop_cuts(server):
    """Tokens inside a character are labelled by their bytes (``bytes:\\xNN``, as vLLM), so alternatives do not
    collide on U+FFFD; offsets point into the returned text; a stop string cut inside a token drops that token;
    the review's other bad inputs are 400s."""
    status, out = http("POST", server.url + "/v1/completions", {
        "model": MODEL, "prompt": "Café 😀 naïve 日本語", "max_tokens": 0, "echo": True, "logprobs": 3}, AUTH)
    assert status == 200, out
    lp, text = out["choices"][0]["logprobs"], out["choices"][0]["text"]
    assert not any("\ufffd" in t for t in lp["tokens"])
    assert any(t.startswith("bytes:") for t in lp["tokens"])
    assert all(0 <= o <= len(text) for o in lp["text_offset"]) and lp["text_offset"] == sorted(lp["text_offset"])
    for i, top in enumerate(lp["top_logprobs"][1:], 1):
        assert lp["tokens"][i] in top and top[lp["tokens"][i]] == lp["token_logprobs"][i]
    status, out = http("POST", server.url + "/v1/completions", {
        "model": MODEL, "prompt": "The capital of France is", "max_tokens": 10, "temperature": 0, "logprobs": 0,
        "stop": ["ari"]}, AUTH)
    c = out["choices"][0]
    assert c["text"] == " P" and "".join(c["logprobs"]["tokens"]) in ("", " P")
    _error(*http("POST", server.url + "/v1/completions", {"model": MODEL, "prompt": "Hi", "repetition_penalty": 1e-300},
                 AUTH), 400, param="repetition_penalty")
    _error(*http("POST", server.url + "/v1/completions", {"model": MODEL, "prompt": "Hi", "echo": True,
                                                          "stream": True}, AUTH), 400, param="echo")
    deep = {"type": "array", "items": {}}
    for _ in range(200):
        deep = {"type": "array", "items": deep}
    for bad_schema in (False, deep):
        _error(*http("POST", server.url + "/v1/chat/completions", {
            "model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2,
            "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": bad_schema}}}, AUTH),
            400, param="response_format")
    out = http("POST", server.url + "/v1/completions", {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 1,
                                                        "n": 3}, AUTH)[1]
    one = http("POST", server.url + "/v1/completions", {"model": MODEL, "prompt": "Once upon a time",
                                                        "max_tokens": 1}, AUTH)[1]
    assert out["usage"]["prompt_tokens"] == one["usage"]["prompt_tokens"]  # the prompt counts once, not per choice
