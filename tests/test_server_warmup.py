"""A warmed-up server compiles nothing while serving: base and adapter requests, streamed or not, and an adapter
loaded into the pool after warm-up. (The H200 start-up benchmark found three step compiles at the first requests:
warm-up had run with an uncommitted pool and serving with a committed one.)"""

from __future__ import annotations

import openai
import pytest
from server_fixtures import BASE_NAME, start_server


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    server = start_server(tmp_path_factory.mktemp("warm"), n_adapters=3, warmup=True, max_batch_size=4,
                          max_loras=2, max_model_len=64, max_prefill_tokens=64, num_pages=64)
    yield server
    server.stop()


def test_serving_after_warmup_compiles_nothing(srv):
    client = openai.OpenAI(base_url=srv.base_url, api_key="unused", max_retries=0, timeout=300)
    assert srv.engine.compiles_since_warmup() == 0
    for i, model in enumerate([BASE_NAME, *srv.adapters, BASE_NAME]):  # 3 adapters through 2 pool slots
        stream = i % 2 == 1
        r = client.completions.create(model=model, prompt=f"Request {i} says", max_tokens=5, temperature=0.7,
                                      seed=i, stream=stream)
        text = "".join(c.choices[0].text for c in r) if stream else r.choices[0].text
        assert isinstance(text, str)
    assert srv.engine.compiles_since_warmup() == 0
