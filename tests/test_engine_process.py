"""``--engine-process``: the real ``python -m slora_jax.serve`` with its engine in a child process answers exactly as
the server with the engine in-process (the reference: ``cli.build_server`` on the same flags, in this process), and
fails cleanly when the child dies.

One engine-process server for the module (its child loads the tiny model and compiles on first use) and one more
for the kill test; requests are small so the file stays cheap.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import jax
import jsonschema
import numpy as np
import pytest
from server_fixtures import BASE_NAME, write_adapters, write_model_with_tokenizer

from slora_jax.model.config import ModelConfig
from slora_jax.serve.cli import build_parser, build_server
from slora_jax.tools import synth

FLAGS = ["--num-pages", "256", "--max-model-len", "256", "--max-batch-size", "8", "--max-loras", "4",
         "--max-lora-rank", "32", "--no-warmup", "--port", "0", "--served-model-name", BASE_NAME,
         "--shutdown-grace-s", "0.5"]
SCHEMA = {"type": "object", "additionalProperties": False, "required": ["ok", "level"],
          "properties": {"ok": {"type": "boolean"}, "level": {"enum": ["low", "mid", "high"]}}}


def _children(pid: int) -> list[int]:
    try:
        return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except FileNotFoundError:
        return []


def _engine_child(pid: int) -> int:
    """The engine process among ``pid``'s children (not multiprocessing's resource tracker)."""
    for child in _children(pid):
        cmd = Path(f"/proc/{child}/cmdline").read_bytes().replace(b"\0", b" ")
        if b"spawn_main" in cmd:
            return child
    raise AssertionError(f"no engine process under {pid}: {_children(pid)}")


PF_EXITING = 0x4  # the kernel's task flag: the process has called exit (its memory and files may still be freed)


def _stat(pid: int) -> tuple[str, int] | None:
    """(state, kernel flags) of ``pid`` from /proc, or None once it is reaped."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()
    except (FileNotFoundError, ProcessLookupError):  # reaped before the open, or between the open and the read
        return None
    return fields[0], int(fields[6])


def _alive(pid: int) -> bool:
    """Not yet exiting. A process that has called exit counts as gone: on a busy GPU the driver can take seconds to
    free its context after that (the GPU suite once saw an engine process still in /proc 10 s after the server's
    exit), which is the kernel's time, not ours."""
    stat = _stat(pid)
    return stat is not None and stat[0] not in "ZX" and not stat[1] & PF_EXITING


class ProcServer:
    """``python -m slora_jax.serve --engine-process`` in a subprocess."""

    def __init__(self, root: Path, model_dir: Path, adapter_dir: Path):
        """``root / "xla"``: the compilation cache (a second server on the same model compiles nothing)."""
        cmd = [sys.executable, "-m", "slora_jax.serve", "--engine-process", "--model", str(model_dir),
               "--adapter-dir", str(adapter_dir), *FLAGS, "--compilation-cache-dir", str(root / "xla")]
        # the child runs where the reference runs (its own platform): a CPU engine against a GPU reference differs in
        # the last bits of every logprob (the GPU suite: no preallocation, so both fit beside the other workers)
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.lines: list[str] = []
        threading.Thread(target=lambda: self.lines.extend(self.proc.stdout), daemon=True).start()
        deadline, self.url = time.monotonic() + 240, None
        while self.url is None:
            assert self.proc.poll() is None, "".join(self.lines)
            assert time.monotonic() < deadline, "".join(self.lines)
            found = [m for line in list(self.lines) if (m := re.search(r"slora-jax ready: (http://\S+)/v1", line))]
            self.url = found[0].group(1) if found else None
            time.sleep(0.1)
        self.child = _engine_child(self.proc.pid)

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(30)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("engine_process")
    model_dir = write_model_with_tokenizer(root / "model")
    cfg = ModelConfig.from_model_dir(model_dir)
    adapters = list(write_adapters(root / "adapters", cfg, 3))
    proc = ProcServer(root, model_dir, root / "adapters")
    # the reference: the same flags, the engine in this process (no compilation cache: it is process-wide config)
    ref = build_server(build_parser().parse_args(["--model", str(model_dir), "--adapter-dir", str(root / "adapters"),
                                                  *FLAGS, "--no-compilation-cache", "--log-level", "warning"]))
    ref.start_background()
    yield proc, ref, adapters, root, cfg
    ref.stop()
    proc.stop()


def _post(url: str, path: str, body: dict) -> httpx.Response:
    return httpx.post(url + path, json=body, timeout=120)


def _both(setup, path: str, body: dict) -> tuple[dict, dict]:
    proc, ref = setup[0], setup[1]
    a, b = _post(proc.url, path, body), _post(ref.url, path, body)
    assert a.status_code == b.status_code == 200, (a.text, b.text)
    return a.json(), b.json()


def _choices(body: dict) -> list[dict]:
    return [{k: v for k, v in c.items()} for c in body["choices"]]


def _top_values(top) -> list[float]:
    """A top-logprobs entry's values, best first: ``{token: logprob}`` (completions) or ``[{token, logprob, ...}]``."""
    values = top.values() if isinstance(top, dict) else [t["logprob"] for t in top]
    return sorted(values, reverse=True)


def _differences(a, b, relaxed: bool, path: str = "") -> list[str]:
    """Where ``a`` and ``b`` differ. ``relaxed`` (GPU): floats may differ by 1e-3 and a top-logprobs entry is compared
    by its values only: the two processes compile the same step apart, XLA's autotuner may pick another GEMM algorithm
    in each, and bf16 logits tie often enough that a one-ulp change reorders tied candidates. The sampled tokens, their
    text and every other field must still be identical. Not relaxed (CPU): everything exactly."""
    if not relaxed:
        return [] if a == b else [f"{path}: {a!r} != {b!r}"]
    if isinstance(a, float) or isinstance(b, float):
        ok = isinstance(a, (int, float)) and isinstance(b, (int, float)) and abs(a - b) <= 1e-3 * max(1.0, abs(b))
        return [] if ok else [f"{path}: {a!r} != {b!r}"]
    if isinstance(a, dict) and isinstance(b, dict):
        if a.keys() != b.keys():
            return [f"{path}: keys {sorted(a)} != {sorted(b)}"]
        return [d for k in a for d in (
            _top_differences(a[k], b[k], f"{path}.{k}") if k == "top_logprobs"
            else _differences(a[k], b[k], relaxed, f"{path}.{k}"))]
    if isinstance(a, list) and isinstance(b, list):
        if len(a) != len(b):
            return [f"{path}: {len(a)} items != {len(b)}: {a!r} != {b!r}"]
        return [d for i, (x, y) in enumerate(zip(a, b, strict=True))
                for d in _differences(x, y, relaxed, f"{path}[{i}]")]
    return [] if a == b else [f"{path}: {a!r} != {b!r}"]


def _top_differences(a, b, path: str) -> list[str]:
    if isinstance(a, list) and a and "logprob" not in a[0]:  # completions: one {token: logprob} dict per position
        if not isinstance(b, list) or len(a) != len(b):
            return [f"{path}: {a!r} != {b!r}"]
        return [d for i, (x, y) in enumerate(zip(a, b, strict=True)) for d in _top_differences(x, y, f"{path}[{i}]")]
    if a is None or b is None:
        return [] if a is b else [f"{path}: {a!r} != {b!r}"]
    return _differences(_top_values(a), _top_values(b), True, path + "(values)")


def _assert_same(a, b) -> None:
    diffs = _differences(a, b, relaxed=jax.default_backend() != "cpu")
    assert not diffs, "\n".join(diffs[:20])


def _stream(url: str, body: dict) -> list[dict]:
    events = []
    with httpx.stream("POST", url + "/v1/chat/completions", json={**body, "stream": True}, timeout=120) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                events.append(json.loads(line[6:]))
    return events


def _streamed_choices(events: list[dict]) -> dict[int, dict]:
    out: dict[int, dict] = {}
    for e in events:
        for c in e["choices"]:
            d = out.setdefault(c["index"], {"text": "", "ids": [], "finish": None, "logprobs": []})
            d["text"] += c["delta"].get("content") or ""
            d["ids"] += c.get("token_ids") or []
            d["finish"] = c["finish_reason"] or d["finish"]
            d["logprobs"] += (c.get("logprobs") or {}).get("content") or []
    return out


def test_completions_match_the_in_process_server(setup):
    """Greedy, seeded sampling with n > 1 and logprobs, and a stop string: the same answers."""
    cfg, adapters = setup[4], setup[2]
    rng = np.random.default_rng()
    prompt = rng.integers(3, cfg.vocab_size, int(rng.integers(4, 12))).tolist()
    adapter = adapters[int(rng.integers(len(adapters)))]
    greedy = {"model": adapter, "prompt": prompt, "max_tokens": 12, "temperature": 0, "return_token_ids": True,
              "ignore_eos": True}
    a, b = _both(setup, "/v1/completions", greedy)
    _assert_same(_choices(a), _choices(b))
    assert len(a["choices"][0]["token_ids"]) == 12
    seeded = {"model": BASE_NAME, "prompt": prompt, "max_tokens": 10, "temperature": 0.9, "top_p": 0.9, "n": 2,
              "seed": int(rng.integers(2**31)), "logprobs": 2, "return_token_ids": True, "ignore_eos": True}
    a, b = _both(setup, "/v1/completions", seeded)
    _assert_same(_choices(a), _choices(b))
    assert len(a["choices"]) == 2
    assert a["choices"][0]["token_ids"] != a["choices"][1]["token_ids"]  # two samples, not one twice
    assert a["usage"] == b["usage"]
    text = a["choices"][0]["text"]
    # a stop string the answer is sure to hit (two visible characters past its start)
    stop = next(text[i:i + 2] for i in range(1, len(text) - 1) if text[i:i + 2].isprintable()
                and len(text[i:i + 2].strip()) == 2)
    a, b = _both(setup, "/v1/completions", {**seeded, "n": 1, "stop": [stop]})
    _assert_same(_choices(a), _choices(b))
    assert a["choices"][0]["finish_reason"] == "stop"
    assert stop not in a["choices"][0]["text"] and text.startswith(a["choices"][0]["text"])


def test_streaming_chat_matches_the_in_process_server(setup):
    proc, ref, adapters = setup[0], setup[1], setup[2]
    rng = np.random.default_rng()
    body = {"model": adapters[int(rng.integers(len(adapters)))],
            "messages": [{"role": "user", "content": f"hello {int(rng.integers(1000))}"}], "max_tokens": 10,
            "temperature": 0.7, "seed": int(rng.integers(2**31)), "logprobs": True, "top_logprobs": 2,
            "return_token_ids": True, "ignore_eos": True}
    a, b = _streamed_choices(_stream(proc.url, body)), _streamed_choices(_stream(ref.url, body))
    _assert_same(a, b)
    assert len(a[0]["ids"]) == 10 and a[0]["finish"] == "length"


def test_structured_output_compiles_in_the_engine_process(setup):
    body = {"model": BASE_NAME, "prompt": "answer:", "max_tokens": 40, "temperature": 0,
            "response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": SCHEMA}}}
    a, b = _both(setup, "/v1/completions", body)
    _assert_same(_choices(a), _choices(b))
    jsonschema.validate(json.loads(a["choices"][0]["text"]), SCHEMA)
    bad = _post(setup[0].url, "/v1/completions", {**body, "response_format": {"type": "json_schema", "json_schema": {
        "name": "s", "schema": {"type": "nonsense"}}}})
    assert bad.status_code == 400


def test_adapters_load_pin_and_unload_at_run_time(setup):
    proc, ref, _, root, cfg = setup
    name = f"late-{int(np.random.default_rng().integers(10**6))}"
    synth.write_adapter(root / "adapters" / name, cfg, rank=8, targets=("q_proj", "v_proj"), seed=7)
    for url in (proc.url, ref.url):
        r = _post(url, "/v1/load_lora_adapter", {"lora_name": name, "lora_path": name})
        assert r.status_code == 200, r.text
    assert name in [m["id"] for m in httpx.get(proc.url + "/v1/models").json()["data"]]
    body = {"model": name, "prompt": [5, 6, 7], "max_tokens": 6, "temperature": 0, "return_token_ids": True}
    a, b = _both(setup, "/v1/completions", body)
    _assert_same(_choices(a), _choices(b))
    pinned = _post(proc.url, "/v1/adapters/pin", {"lora_name": name}).json()
    assert pinned["status"] == "pinned" and pinned["explicit_pins"] == 1
    conflict = _post(proc.url, "/v1/unload_lora_adapter", {"lora_name": name})
    assert conflict.status_code == 409 and "pin" in conflict.json()["error"]["message"]  # the engine's error, mapped
    assert _post(proc.url, "/v1/adapters/unpin", {"lora_name": name}).status_code == 200
    on_device = httpx.get(proc.url + "/v1/adapters", params={"tier": "device"}).json()["data"]
    assert name in [d["name"] for d in on_device]
    assert _post(proc.url, "/v1/unload_lora_adapter", {"lora_name": name}).status_code == 200
    assert _post(proc.url, "/v1/completions", body).status_code == 404
    assert _post(proc.url, "/v1/unload_lora_adapter", {"lora_name": name}).status_code == 404
    assert _post(ref.url, "/v1/unload_lora_adapter", {"lora_name": name}).status_code == 200


def _metric(url: str, name: str) -> float:
    text = httpx.get(url + "/metrics").text
    found = re.findall(rf"^{re.escape(name)} (\S+)$", text, re.M)
    return float(found[0]) if found else float("nan")


def test_metrics_and_an_abort_on_disconnect(setup):
    proc, adapters = setup[0], setup[2]
    body = {"model": adapters[0], "messages": [{"role": "user", "content": "go on"}], "max_tokens": 200,
            "ignore_eos": True}
    with httpx.stream("POST", proc.url + "/v1/chat/completions", json={**body, "stream": True}, timeout=60) as r:
        seen = 0
        for line in r.iter_lines():
            seen += line.startswith("data: ")
            if seen >= 4:
                break  # leave: the server must abort the request in the engine
    deadline = time.monotonic() + 20
    while _metric(proc.url, "slora_requests_running") != 0:
        assert time.monotonic() < deadline, "the abandoned request is still running"
        time.sleep(0.1)
    steps = _metric(proc.url, "slora_engine_steps")
    time.sleep(0.5)
    assert _metric(proc.url, "slora_engine_steps") == steps  # idle: nothing left running in the child
    text = httpx.get(proc.url + "/metrics").text
    assert re.search(rf'^slora_adapter_pool_loads_total{{adapter="{adapters[0]}"}} [1-9]', text, re.M)  # events
    assert re.search(r'^slora_request_finish_total{reason="client_disconnect"} [1-9]', text, re.M)
    assert steps > 0


def test_sigterm_stops_the_engine_process(setup):
    """Last in this file: the module's server shuts down and leaves no process behind."""
    proc = setup[0]
    assert _alive(proc.child)
    assert proc.stop() == 0, "".join(proc.lines)
    deadline = time.monotonic() + 10
    while _alive(proc.child):
        assert time.monotonic() < deadline, (f"the engine process outlived the server: /proc stat {_stat(proc.child)}"
                                             "\n" + "".join(proc.lines[-30:]))
        time.sleep(0.1)


def test_a_dead_engine_process_fails_requests_and_health(setup):
    root = setup[3]
    server = ProcServer(root, root / "model", root / "adapters")
    try:
        events: list = []

        def read():
            body = {"model": BASE_NAME, "messages": [{"role": "user", "content": "long"}], "max_tokens": 240,
                    "ignore_eos": True}
            with httpx.stream("POST", server.url + "/v1/chat/completions", json={**body, "stream": True},
                              timeout=60) as r:
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        events.append(line[6:])

        reader = threading.Thread(target=read)
        reader.start()
        deadline = time.monotonic() + 60
        while len(events) < 3:
            assert time.monotonic() < deadline and reader.is_alive(), events
            time.sleep(0.02)
        os.kill(server.child, signal.SIGKILL)
        reader.join(30)
        assert not reader.is_alive() and events[-1] == "[DONE]"
        error = json.loads(events[-2])["error"]
        assert error["code"] == 500 and "engine process exited" in error["message"], error
        health = httpx.get(server.url + "/health")
        assert health.status_code == 503 and "killed by signal 9" in health.json()["error"]["message"]
        r = _post(server.url, "/v1/completions", {"model": BASE_NAME, "prompt": [3, 4], "max_tokens": 2})
        assert r.status_code == 503 and "engine process exited" in r.json()["error"]["message"]
        r = _post(server.url, "/v1/adapters/pin", {"lora_name": "ad-000"})  # a named call: 503 too, not 500
        assert r.status_code == 503 and "engine process exited" in r.json()["error"]["message"], r.text
    finally:
        assert server.stop() == 0, "".join(server.lines)


STAND_IN = '''
import asyncio, sys, time, types
from slora_jax.engine.sampling import SamplingParams
from slora_jax.engine.sequence import RequestOutput


class StandIn:
    """One token a step per open request; a step with a request whose prompt holds 13 raises."""
    cfg = types.SimpleNamespace(vocab_size=50, eos_token_id=2)
    ecfg = types.SimpleNamespace(max_model_len=64)

    def __init__(self):
        self.open = {}

    def adapter_names(self):
        return ["a"]

    def add_request(self, prompt_ids, adapter=None, sampling=None, request_id=None, on_output=None, **_):
        self.open[request_id] = [sampling.max_tokens, 0, on_output, 13 in prompt_ids]
        return request_id

    def has_unfinished(self):
        return bool(self.open)

    def running_request_ids(self):
        return list(self.open)

    def pool_lost(self):
        return False

    def abort(self, rid):
        r = self.open.pop(rid, None)
        if r is not None:
            r[2](RequestOutput(rid, [], True, "abort"))
        return r is not None

    def release(self, rid):
        pass

    def step(self):
        time.sleep(0.005)
        if any(r[3] for r in self.open.values()):
            self.open = {k: r for k, r in self.open.items() if r[3]}  # the others finished before: keep them out
            raise RuntimeError("bad step")
        outs = []
        for rid, r in list(self.open.items()):
            r[1] += 1
            done = r[1] >= r[0]
            outs.append(RequestOutput(rid, [r[1]], done, "length" if done else None))
            if done:
                del self.open[rid]
            r[2](outs[-1])
        return outs


def stand_in():
    return StandIn(), {"hello": 1}


async def main(client):
    async def run(rid, prompt, n):
        s = await client.submit(prompt, None, SamplingParams(max_tokens=n), rid)
        outs = [o async for o in s]
        return [t for o in outs for t in o.new_token_ids], outs[-1].finish_reason, outs[-1].error

    assert await run("ok", [1, 2], 4) == ([1, 2, 3, 4], "length", None)
    ids, reason, error = await run("bad", [13], 4)
    assert reason == "error" and "bad step" in error, (reason, error)
    assert await run("after", [1], 2) == ([1, 2], "length", None)
    assert client.step_failures == 1 and client.healthy and client.info == {"hello": 1}
    assert client.engine.adapter_names() == ["a"] and client.engine.has_adapter("a")


if __name__ == "__main__":
    from slora_jax.serve.engine_client import EngineClient

    client = EngineClient.launch(stand_in, (), log_level="error")
    asyncio.run(main(client))
    print("child", client.pid, flush=True)
    time.sleep(120)
'''


def test_a_stand_in_engine_steps_in_the_child_and_dies_with_its_server(tmp_path):
    """A failed step fails only its request, the status crosses the pipe, and when the server process is killed
    (no shutdown at all) its engine process exits by itself."""
    script = tmp_path / "stand_in_server.py"
    script.write_text(STAND_IN)
    path = os.pathsep.join(filter(None, (str(Path.cwd()), os.environ.get("PYTHONPATH"))))  # keep the GPU image's
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=path))
    try:
        seen = []
        while not (seen and seen[-1].startswith("child ")):  # the child's log (the failed step) comes first
            seen.append(proc.stdout.readline())
            assert seen[-1], "".join(seen)  # the script ended without reaching its end: its asserts say why
        child = int(seen[-1].split()[1])
        assert _alive(child) and child in _children(proc.pid)
        proc.kill()
        proc.wait(10)
        deadline = time.monotonic() + 15
        while _alive(child):
            assert time.monotonic() < deadline, "the engine process outlived its killed server"
            time.sleep(0.05)
    finally:
        if proc.poll() is None:
            proc.kill()
