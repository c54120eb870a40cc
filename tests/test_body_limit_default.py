"""The body limit follows the prompt limit: a prompt the server would take by its character count is never refused
first for the size of its JSON body (4 MiB once, whatever --max-prompt-chars said)."""

from __future__ import annotations

import json

import httpx
import pytest
from server_fixtures import BASE_NAME, start_server_with_options

from slora_jax.serve.config import DEFAULT_MAX_MODEL_LEN, MIN_BODY_BYTES, ServerConfig, body_bytes_limit, context_len

PROMPT_CHARS = 800_000


def test_the_default_is_six_bytes_a_prompt_character_and_one_mib_at_least_four():
    assert body_bytes_limit(None, None, 2048) == MIN_BODY_BYTES  # 32 x 2048 characters fit in 4 MiB
    assert body_bytes_limit(None, None, 32768) == 6 * 32 * 32768 + 2**20
    assert body_bytes_limit(None, PROMPT_CHARS, 2048) == 6 * PROMPT_CHARS + 2**20
    assert body_bytes_limit(12345, PROMPT_CHARS, 2048) == 12345  # set: kept as given
    assert ServerConfig(served_model_name="m", max_prompt_chars=10).body_bytes_limit(64) == MIN_BODY_BYTES
    with pytest.raises(ValueError, match="max_body_bytes"):
        ServerConfig(served_model_name="m", max_body_bytes=0)


def test_the_context_without_max_model_len_is_one_rule_for_the_cli_and_the_ray_ingress():
    """The Ray ingress loads no model, so it sizes bodies for the CLI's default context; both read context_len."""
    assert DEFAULT_MAX_MODEL_LEN == 2048
    assert context_len(None) == 2048  # the ingress: no model limits known
    assert context_len(None, 4096, None) == 2048 and context_len(None, 1024, 0) == 1024
    assert context_len(None, 4096, 512) == 512  # a sliding window shorter than the default
    assert context_len(3000, 1024, 512) == 3000  # --max-model-len set: kept (the engine checks it against the model)


@pytest.fixture(scope="module")
def http(tmp_path_factory):
    server = start_server_with_options(tmp_path_factory.mktemp("body"), dict(max_prompt_chars=PROMPT_CHARS),
                                       n_adapters=1)
    with httpx.Client(base_url=server.url, timeout=120) as client:
        yield client
    server.stop()


def test_a_long_escaped_prompt_within_the_character_limit_reaches_the_prompt_checks(http):
    """700k non-ASCII characters, escaped as a Python client does (6 bytes each: a 4.2 MB body, over the old fixed
    4 MiB): refused for its tokens (400, the context is 256), not for its size; a body over 6 x 800k + 1 MiB is 413."""
    body = json.dumps({"model": BASE_NAME, "prompt": "\u00e9" * 700_000, "max_tokens": 1})
    assert len(body) > MIN_BODY_BYTES
    r = http.post("/v1/completions", content=body, headers={"Content-Type": "application/json"})
    assert r.status_code == 400, r.text[:300]
    assert "token" in r.json()["error"]["message"]
    big = json.dumps({"model": BASE_NAME, "prompt": "x" * (6 * PROMPT_CHARS + 2**20)})
    r = http.post("/v1/completions", content=big, headers={"Content-Type": "application/json"})
    assert r.status_code == 413, r.text[:300]
    assert http.get("/health").status_code == 200
