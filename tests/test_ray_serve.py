"""Scale-out on Ray Serve: a local Ray cluster started by the test, two laserlm replicas behind Ray Serve's proxy on
127.0.0.1, answered by both (their replica ids differ), then Serve and Ray torn down."""

from __future__ import annotations

import pytest
from server_helpers import free_port, http

ray = pytest.importorskip("ray")
serve = pytest.importorskip("ray.serve")
openai = pytest.importorskip("openai")


@pytest.fixture(scope="module")
def ray_cluster():
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)
    yield
    try:
        serve.shutdown()
    finally:
        ray.shutdown()


def test_two_replicas_answer(ray_cluster, smol):
    from laserlm.serve.app import ServerSettings
    from laserlm.serve.ray_serve import deploy

    port = free_port()
    settings = ServerSettings(model="smollm2-135m", weights="fp32", threads=1, ctx_size=512, kv_budget=32)
    deploy(settings, replicas=2, port=port, num_cpus=0.5)
    url = f"http://127.0.0.1:{port}"
    replicas = {http("GET", url + "/health")[1]["replica"] for _ in range(40)}
    assert len(replicas) == 2  # both replicas answered
    client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=300)
    ref = smol.generate("The capital of France is", max_new_tokens=8).text
    for _ in range(4):
        r = client.completions.create(model="smollm2-135m", prompt="The capital of France is", max_tokens=8,
                                      temperature=0)
        assert r.choices[0].text == ref
    chunks = list(client.chat.completions.create(model="smollm2-135m", max_tokens=6, temperature=0, stream=True,
                                                 messages=[{"role": "user", "content": "Hi"}]))
    assert chunks[-1].choices[0].finish_reason in ("length", "stop")
    serve.shutdown()
    with pytest.raises(OSError):
        http("GET", url + "/health", timeout=5)
