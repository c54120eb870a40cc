"""Scheduling policies and the prefix cache through the HTTP server: flags, per-request fields, status codes, metrics.

Two servers on the same tiny model and adapters (identical weights): ``plain`` (defaults: fcfs, no deadline, no
prefix cache; tenant header ``X-Team``) and ``policy`` (slo, early abort, a default first-token deadline of a
microsecond that no request can meet, prefix caching on). Greedy tokens from ``policy`` must equal ``plain``'s: a
policy changes when a request runs, never what it answers.
"""

from __future__ import annotations

import asyncio
import json
import logging

import httpx
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file
from server_fixtures import BASE_NAME, start_server, start_server_with_options

from slora_jax.engine.config import EngineConfig
from slora_jax.engine.sampling import SamplingParams
from slora_jax.model.config import ModelConfig
from slora_jax.serve.cli import build_parser, scheduling_options
from slora_jax.serve.config import ServerConfig
from slora_jax.tools import synth

TINY_SLO = 1e-6  # the policy server's default deadline: every request without its own is ended, never served late
GENEROUS = 600.0
TENANT_HEADER = "X-Team"
MAX_TOKENS = 6
PROMPT = "The quick brown fox"


@pytest.fixture(scope="module")
def plain(tmp_path_factory):
    server = start_server_with_options(tmp_path_factory.mktemp("plain"), dict(tenant_header=TENANT_HEADER),
                                       n_adapters=2)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def policy(tmp_path_factory):
    server = start_server(tmp_path_factory.mktemp("policy"), n_adapters=2, scheduling_policy="slo",
                          early_abort=True, first_token_slo_s=TINY_SLO, prefix_cache=True)
    yield server
    server.stop()


def body(model: str = "ad-001", prompt=PROMPT, **extra) -> dict:
    return {"model": model, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "return_token_ids": True,
            **extra}


def metric(text: str, sample: str) -> float | None:
    """The value of one sample line (``name{labels}``) of a Prometheus text page, None if absent."""
    for line in text.splitlines():
        if line.startswith(sample + " "):
            return float(line.rsplit(" ", 1)[1])
    return None


def sse_events(text: str) -> list[str]:
    return [e.removeprefix("data: ") for e in text.split("\n\n") if e]


def assert_deadline_error(err: dict) -> None:
    assert err["code"] == 503 and err["type"] == "deadline_exceeded", err
    assert "deadline" in err["message"] and "not served late" in err["message"], err


# ---------------------------------------------------------------- early abort


def test_missed_deadline_is_503_while_a_generous_one_is_served_greedy(policy, plain):
    """Sent together: the request under the server's microsecond deadline is ended with 503 and the engine's reason;
    the one carrying its own generous first_token_slo_s gets exactly the greedy tokens of a server without policies."""
    want = plain.offline_generate([plain.tokenizer.encode(PROMPT)], ["ad-001"],
                                  SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0))[0]

    async def run():
        async with httpx.AsyncClient(base_url=policy.base_url, timeout=120) as client:
            return await asyncio.gather(client.post("/completions", json=body()),
                                        client.post("/completions", json=body(first_token_slo_s=GENEROUS)))

    late, ok = asyncio.run(run())
    assert late.status_code == 503, late.text
    assert_deadline_error(late.json()["error"])
    assert ok.status_code == 200, ok.text
    assert ok.json()["choices"][0]["token_ids"] == want
    assert policy.wait_idle()["pool"]["pages_kv"] == policy.stats()["prefix_cache"]["cached_pages"]


def test_missed_deadline_in_a_stream_is_an_error_event_then_done(policy):
    with httpx.Client(base_url=policy.base_url, timeout=120) as client:
        r = client.post("/completions", json=body(stream=True))
        chat = client.post("/chat/completions", json={"model": BASE_NAME, "max_tokens": 4,
                                                      "messages": [{"role": "user", "content": "Hi"}]})
    assert r.status_code == 200  # the stream had started
    events = sse_events(r.text)
    assert events[-1] == "[DONE]"
    assert_deadline_error(json.loads(events[-2])["error"])
    assert not any("token_ids" in e for e in events[:-2])  # no token was served late
    assert chat.status_code == 503
    assert_deadline_error(chat.json()["error"])


def test_deadline_aborts_are_counted_in_metrics(policy):
    with httpx.Client(base_url=policy.url, timeout=120) as client:
        before = metric(client.get("/metrics").text, 'slora_request_finish_total{reason="deadline"}') or 0.0
        assert client.post("/v1/completions", json=body()).status_code == 503
        text = client.get("/metrics").text
    assert metric(text, 'slora_request_finish_total{reason="deadline"}') == before + 1
    aborts = policy.stats()["deadline_aborts"]  # nothing ran since the scrape
    assert aborts > 0 and metric(text, "slora_deadline_aborts") == aborts


# ---------------------------------------------------------------- request fields


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
@pytest.mark.parametrize("raw", ["0", "-1", "-0.5", '"x"', '"5"', "true", "1e400", "-1e400", "NaN", "[1]"])
def test_bad_first_token_slo_is_400(plain, path, raw):
    base = body(BASE_NAME) if "chat" not in path else {"model": BASE_NAME, "max_tokens": 2,
                                                       "messages": [{"role": "user", "content": "Hi"}]}
    text = json.dumps(base)[:-1] + f', "first_token_slo_s": {raw}}}'
    r = httpx.post(plain.url + path, content=text.encode(), headers={"Content-Type": "application/json"}, timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert "first_token_slo_s" in err["message"] or err["param"] == "first_token_slo_s", err


def test_tenant_header_and_deadline_reach_the_engine(plain, monkeypatch):
    seen = []
    real = plain.engine.add_request

    def spy(*args, **kwargs):
        seen.append((kwargs.get("tenant"), kwargs.get("first_token_slo_s")))
        return real(*args, **kwargs)

    monkeypatch.setattr(plain.engine, "add_request", spy)
    chat = {"model": BASE_NAME, "max_tokens": 2, "messages": [{"role": "user", "content": "Hi"}]}
    with httpx.Client(base_url=plain.base_url, timeout=120) as client:
        sent = [client.post("/completions", json=body(), headers={TENANT_HEADER: "team-a"}),
                client.post("/chat/completions", json={**chat, "first_token_slo_s": 5},
                            headers={TENANT_HEADER.lower(): "team b"}),
                client.post("/completions", json=body(), headers={"X-Tenant-Id": "not-the-configured-header"}),
                client.post("/completions", json=body(), headers={TENANT_HEADER: ""})]
        assert [r.status_code for r in sent] == [200] * 4, [r.text for r in sent]
        assert seen == [("team-a", None), ("team b", 5.0), (None, None), (None, None)]
        for value in ("t" * 257, b"caf\xe9", b"a\tb"):
            r = client.post("/completions", json=body(), headers={TENANT_HEADER: value})
            assert r.status_code == 400, r.text
            assert r.json()["error"]["param"] == TENANT_HEADER
    assert len(seen) == 4  # refused before the engine


def test_adapter_failure_is_400_by_error_kind(plain):
    """An adapter whose weights fail to load while its request waits: the engine's error_kind 'adapter' -> 400."""
    cfg = ModelConfig.from_model_dir(plain.model_dir)
    path = synth.write_adapter(plain.adapter_dir / "poisoned", cfg, rank=4, seed=7)
    weights = load_file(str(path / "adapter_model.safetensors"))
    name = sorted(weights)[0]
    weights[name] = np.full_like(weights[name], np.nan)
    save_file(weights, str(path / "adapter_model.safetensors"))
    plain.engine.register_adapter("poisoned", path)  # shapes only: the weights are read on first use
    r = httpx.post(plain.base_url + "/completions", json=body("poisoned"), timeout=120)
    assert r.status_code == 400, r.text
    assert "poisoned" in r.json()["error"]["message"]


# ---------------------------------------------------------------- prefix cache


SHARED = list(range(3, 103))  # 100 token ids: six full pages of 16


def test_prefix_cache_same_greedy_tokens_and_hits_in_metrics(policy, plain):
    prompts = [SHARED + [200, 201], SHARED + [300]]
    before = policy.stats()["prefix_cache"].get("hit_pages", 0)
    got, want = [], []
    for model in ("ad-000", BASE_NAME):
        for prompt in prompts:  # one after the other: the first one's pages are cached before the second arrives
            for srv, out in ((policy, got), (plain, want)):
                r = httpx.post(srv.base_url + "/completions", timeout=120,
                               json=body(model, prompt, first_token_slo_s=GENEROUS))
                assert r.status_code == 200, r.text
                choice = r.json()["choices"][0]
                out.append((choice["token_ids"], choice["text"]))
    assert got == want
    stats = policy.stats()["prefix_cache"]
    assert stats["hit_pages"] - before == 2 * (len(SHARED) // 16)  # the second prompt of each model: six pages
    text = httpx.get(policy.url + "/metrics").text
    assert metric(text, 'slora_prefix_cache{stat="hit_pages"}') == stats["hit_pages"]
    assert metric(text, 'slora_prefix_cache{stat="cached_pages"}') == stats["cached_pages"] > 0
    assert metric(text, 'slora_prefix_cache{stat="miss_pages"}') == stats["miss_pages"]
    assert 'slora_prefix_cache{' not in httpx.get(plain.url + "/metrics").text  # off there


# ---------------------------------------------------------------- flags


def test_scheduling_flags_become_engine_settings():
    args = build_parser().parse_args(["--scheduling-policy", "vtc", "--first-token-slo-s", "0.25", "--early-abort",
                                      "--enable-prefix-caching", "--vtc-weights", "1,3", "--tenant-header", "X-Org"])
    opts = scheduling_options(args)
    assert opts == dict(scheduling_policy="vtc", first_token_slo_s=0.25, early_abort=True, prefix_cache=True,
                        vtc_input_weight=1.0, vtc_output_weight=3.0, admit_while_loading=True)
    assert args.tenant_header == "X-Org"
    ecfg = EngineConfig(num_pages=8, **opts)
    assert (ecfg.adapter_lookahead, ecfg.adapter_max_bypass) == (16, 32)  # unset flags keep the engine's defaults
    args = build_parser().parse_args(["--scheduling-policy", "adapter-aware", "--adapter-lookahead", "4",
                                      "--adapter-max-bypass", "0"])
    assert scheduling_options(args) == dict(scheduling_policy="adapter-aware", first_token_slo_s=None,
                                            early_abort=False, prefix_cache=False, adapter_lookahead=4,
                                            adapter_max_bypass=0, admit_while_loading=True)
    assert scheduling_options(build_parser().parse_args(["--admit-while-loading"]))["admit_while_loading"] is True
    assert scheduling_options(build_parser().parse_args(["--no-admit-while-loading"]))["admit_while_loading"] is False


def test_default_flags_give_the_servers_defaults():
    args = build_parser().parse_args([])
    assert scheduling_options(args) == dict(scheduling_policy="fcfs", first_token_slo_s=None, early_abort=False,
                                            prefix_cache=False, admit_while_loading=True)  # a server's default
    assert args.tenant_header == "X-Tenant-Id" == ServerConfig(served_model_name="m").tenant_header


def test_a_flag_of_another_policy_is_logged(caplog):
    args = build_parser().parse_args(["--vtc-weights", "1,1", "--adapter-lookahead", "3"])
    with caplog.at_level(logging.WARNING, logger="slora_jax.serve"):
        scheduling_options(args)
    assert "--vtc-weights only applies to --scheduling-policy vtc" in caplog.text
    assert "--adapter-lookahead only applies to --scheduling-policy adapter-aware" in caplog.text


@pytest.mark.parametrize("flag, value, fragment", [
    ("--first-token-slo-s", "0", "positive finite"), ("--first-token-slo-s", "-1", "positive finite"),
    ("--first-token-slo-s", "inf", "positive finite"), ("--first-token-slo-s", "nan", "positive finite"),
    ("--first-token-slo-s", "soon", "number of seconds"),
    ("--vtc-weights", "1", "IN,OUT"), ("--vtc-weights", "1,2,3", "IN,OUT"), ("--vtc-weights", "a,b", "IN,OUT"),
    ("--vtc-weights", "-1,2", ">= 0"), ("--vtc-weights", "0,0", "not both 0"), ("--vtc-weights", "inf,1", "finite"),
    ("--adapter-lookahead", "0", ">= 1"), ("--adapter-lookahead", "x", "integer"),
    ("--adapter-max-bypass", "-1", ">= 0"), ("--adapter-max-bypass", "1.5", "integer"),
    ("--tenant-header", "", "not an HTTP header name"), ("--tenant-header", "X Team", "not an HTTP header name"),
    ("--tenant-header", "x" * 65, "not an HTTP header name"), ("--tenant-header", "Authorization", "standard"),
    ("--scheduling-policy", "lifo", "invalid choice"),
])
def test_bad_flag_values_exit_with_the_reason(flag, value, fragment, capsys):
    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args([f"{flag}={value}"])  # "=": a value such as -1,2 is not taken for a flag
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert flag in err and fragment in err, err


def test_bad_tenant_header_in_server_config():
    with pytest.raises(ValueError, match="not an HTTP header name"):
        ServerConfig(served_model_name="m", tenant_header="X:Team")


def test_help_lists_the_scheduling_flags():
    text = build_parser().format_help()
    for flag in ("--scheduling-policy", "--first-token-slo-s", "--early-abort", "--enable-prefix-caching",
                 "--vtc-weights", "--adapter-lookahead", "--adapter-max-bypass", "--tenant-header"):
        assert flag in text, flag
