"""``--engine-process`` at its edges: the adapter-name mirror after an admin call timed out, the event loop while
the engine process is asked something, a submit cancelled before the engine answered, and signals (SIGTERM to the
whole process group, to an orphaned engine process, an interpreter that exits without stopping its engine).

One in-process server (uvicorn in a thread) drives a real engine process on the tiny model; events shared with that
process hold its adapter calls where a test needs them held.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import multiprocessing
import os
import re
import signal
import subprocess
import sys
import threading
import time
import types
from pathlib import Path

import httpx
import pytest
from server_fixtures import BASE_NAME, SMALL_ENGINE, write_adapters, write_model_with_tokenizer

from slora_jax.engine.engine import QueueFull
from slora_jax.model.config import ModelConfig
from slora_jax.serve.engine_client import EngineClient
from slora_jax.serve.engine_wire import pack_error

SLOW_UNLOAD = "ad-001"  # its unregistration waits for the test's word
BLOCKING_MIX = "mix:block"  # asking whether it exists waits for the test's word


def gated_engine(model_dir, adapters, gates):
    """Runs in the engine process: the tiny engine, with the unregistration of :data:`SLOW_UNLOAD` and the question
    about :data:`BLOCKING_MIX` held until the test sets their gate."""
    from slora_jax.engine.config import EngineConfig
    from slora_jax.engine.engine import Engine
    from slora_jax.tools.tokenizer import load_tokenizer

    engine = Engine.from_model_dir(model_dir, EngineConfig(**SMALL_ENGINE), adapters=adapters,
                                   tokenizer=load_tokenizer(model_dir), progress=False)
    unregister, has_adapter = engine.unregister_adapter, engine.has_adapter

    def held_unregister(name):
        if name == SLOW_UNLOAD:
            gates["unregister"].wait(60)
        return unregister(name)

    def held_has_adapter(name):
        if name == BLOCKING_MIX:
            gates["asked"].set()
            gates["answer"].wait(60)
        return has_adapter(name)

    engine.unregister_adapter, engine.has_adapter = held_unregister, held_has_adapter
    return engine, {}


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    from slora_jax.serve.config import ServerConfig
    from slora_jax.serve.server import Server
    from slora_jax.tools.tokenizer import load_tokenizer

    root = tmp_path_factory.mktemp("engine_process_edges")
    model_dir = write_model_with_tokenizer(root / "model")
    adapters = write_adapters(root / "adapters", ModelConfig.from_model_dir(model_dir), 3)
    ctx = multiprocessing.get_context("spawn")
    gates = {name: ctx.Event() for name in ("unregister", "asked", "answer")}
    client = EngineClient.launch(gated_engine, (model_dir, adapters, gates), log_level="warning")
    config = ServerConfig(served_model_name=BASE_NAME, allowed_adapter_dirs=(root / "adapters",), admin_timeout_s=0.5)
    server = Server(None, config, host="127.0.0.1", port=0, log_level="warning", tokenizer=load_tokenizer(model_dir),
                    runner=client)
    server.start_background()
    yield types.SimpleNamespace(url=server.url, client=client, gates=gates, adapter_dir=root / "adapters")
    for gate in gates.values():
        gate.set()
    server.stop()


def _models(url: str) -> list[str]:
    return [m["id"] for m in httpx.get(url + "/v1/models", timeout=30).json()["data"]]


def _until(condition, timeout: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


# ---------------------------------------------------------------- the adapter-name mirror


def test_a_timed_out_unload_answers_504_and_the_name_goes_when_the_engine_unloads_it(served):
    url = served.url
    r = httpx.post(url + "/v1/unload_lora_adapter", json={"lora_name": SLOW_UNLOAD}, timeout=30)
    assert r.status_code == 504, r.text
    assert "may still" in r.json()["error"]["message"] and r.json()["error"]["type"] == "timeout_error"
    assert SLOW_UNLOAD in _models(url)  # the engine has not unloaded it yet
    served.gates["unregister"].set()  # now it does, long after the route gave up
    assert _until(lambda: SLOW_UNLOAD not in _models(url)), "the engine unloaded it but the server still lists it"
    load = {"lora_name": SLOW_UNLOAD, "lora_path": str(served.adapter_dir / SLOW_UNLOAD)}
    r = httpx.post(url + "/v1/load_lora_adapter", json=load, timeout=60)
    assert r.status_code == 200, r.text
    r = httpx.post(url + "/v1/completions", json={"model": SLOW_UNLOAD, "prompt": [1, 2], "max_tokens": 1}, timeout=60)
    assert r.status_code == 200, r.text


def test_an_unload_the_engine_does_not_know_drops_the_name(served):
    """A name this process lists but the engine does not have (KeyError there): 404, and it is listed no more."""
    served.client.engine._names["ghost"] = None  # as a mirror that missed an unregistration would have it
    r = httpx.post(served.url + "/v1/unload_lora_adapter", json={"lora_name": "ghost"}, timeout=30)
    assert r.status_code == 404, r.text
    assert "ghost" not in _models(served.url)


# ---------------------------------------------------------------- the event loop


@pytest.mark.parametrize("path", ["/v1/unload_lora_adapter", "/v1/adapters/pin", "/v1/adapters/unpin"])
def test_asking_the_engine_process_about_a_mix_leaves_the_event_loop_free(served, path):
    gates = served.gates
    gates["asked"].clear()
    gates["answer"].clear()
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        pending = pool.submit(httpx.post, served.url + path, json={"lora_name": BLOCKING_MIX}, timeout=60)
        try:
            assert gates["asked"].wait(30), "the route never asked the engine process"
            health = httpx.get(served.url + "/health", timeout=5)  # the route still waits for its answer
            assert health.status_code == 200 and not pending.done()
        finally:
            gates["answer"].set()
        assert pending.result().status_code == 404


# ---------------------------------------------------------------- a cancelled submit


def test_a_submit_cancelled_before_the_engine_refused_it_leaves_no_stream():
    """The engine end of the pipe is played here: it refuses the submit only once the caller was cancelled, then
    answers a question (its reply comes after the refusal, so the refusal has been read when it arrives)."""
    mine, theirs = multiprocessing.Pipe(duplex=True)
    got_submit, release = threading.Event(), threading.Event()

    def engine_end():
        while True:
            try:
                batch = theirs.recv()
            except EOFError:
                return
            for msg in batch:
                if msg[0] == "submit":
                    got_submit.set()
                    release.wait(30)
                    theirs.send([("accepted", msg[1], pack_error(QueueFull("10 requests are waiting")))])
                elif msg[0] == "ask":
                    theirs.send([("reply", msg[1], False, None)])
                elif msg[0] == "stop":
                    theirs.close()
                    return

    threading.Thread(target=engine_end, daemon=True).start()
    client = EngineClient(mine, None, {"cfg": None, "ecfg": None, "adapters": []})

    async def go():
        task = asyncio.ensure_future(client.submit([1, 2, 3], None, None, "req-1"))
        assert await asyncio.to_thread(got_submit.wait, 30)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        release.set()
        await asyncio.to_thread(client.ask, "has_adapter", "x", timeout=30)

    try:
        asyncio.run(go())
        assert client._streams == {}, f"leaked streams: {list(client._streams)}"
    finally:
        client.stop(5)


# ---------------------------------------------------------------- signals

FLAGS = ["--num-pages", "256", "--max-model-len", "256", "--max-batch-size", "8", "--max-loras", "4",
         "--max-lora-rank", "32", "--no-warmup", "--port", "0", "--served-model-name", BASE_NAME,
         "--shutdown-grace-s", "60"]


def _gone(pid: int) -> bool:
    """Reaped, a zombie, or exiting (``PF_EXITING``)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()
    except (FileNotFoundError, ProcessLookupError):
        return True
    return fields[0] in "ZX" or bool(int(fields[6]) & 0x4)


def _engine_child(pid: int) -> int:
    for child in Path(f"/proc/{pid}/task/{pid}/children").read_text().split():
        if b"spawn_main" in Path(f"/proc/{child}/cmdline").read_bytes():
            return int(child)
    raise AssertionError(f"no engine process under {pid}")


def _env() -> dict:
    path = os.pathsep.join(filter(None, (str(Path.cwd()), os.environ.get("PYTHONPATH"))))
    return dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=path)


def test_a_sigterm_to_the_whole_process_group_still_drains(tmp_path):
    """As systemd (KillMode=control-group) or ``kill -TERM -PGID`` stop a service: the engine process gets the
    SIGTERM too, and must outlive the drain (it stops when the server says so)."""
    model_dir = write_model_with_tokenizer(tmp_path / "model")
    write_adapters(tmp_path / "adapters", ModelConfig.from_model_dir(model_dir), 1)
    cmd = [sys.executable, "-m", "slora_jax.serve", "--engine-process", "--model", str(model_dir), "--adapter-dir",
           str(tmp_path / "adapters"), *FLAGS, "--compilation-cache-dir", str(tmp_path / "xla")]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=_env(),
                            start_new_session=True)
    lines: list[str] = []
    threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True).start()
    try:
        url, deadline = None, time.monotonic() + 240
        while url is None:
            assert proc.poll() is None and time.monotonic() < deadline, "".join(lines)
            found = [m for line in list(lines) if (m := re.search(r"slora-jax ready: (http://\S+)/v1", line))]
            url = found[0].group(1) if found else None
            time.sleep(0.1)
        child = _engine_child(proc.pid)
        body = {"model": BASE_NAME, "prompt": [1, 2, 3], "max_tokens": 240, "ignore_eos": True, "stream": True}
        outcome, signalled = None, False
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as r:
            for line in r.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[6:])
                if not signalled:
                    os.killpg(proc.pid, signal.SIGTERM)  # the server and its engine process alike
                    signalled = True
                    assert _until(lambda: any("draining" in line for line in list(lines)), 30), "".join(lines)
                    assert not _gone(child), "the engine process died of the group's SIGTERM"
                if "error" in event:
                    outcome = "error: " + event["error"]["message"]
                elif event["choices"][0].get("finish_reason"):
                    outcome = event["choices"][0]["finish_reason"]
        assert outcome == "length", (outcome, "".join(lines[-20:]))
        assert proc.wait(60) == 0, "".join(lines)
        assert _until(lambda: _gone(child), 15), "the engine process outlived its server"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)


ENGINE_STAND_IN = """
import logging, os, signal, sys
logging.basicConfig(level="INFO", stream=sys.stdout, format="%(message)s")
from slora_jax.serve.engine_process import ignore_sigterm_while_parent_lives
ignore_sigterm_while_parent_lives(os.getppid())
print("ready", os.getpid(), flush=True)
while True:
    signal.pause()
"""

ORPHANING_PARENT = """
import subprocess, sys
child = subprocess.Popen([sys.executable, sys.argv[1]], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
print(child.stdout.readline(), end="", flush=True)  # then exit: the child is re-parented
"""


def test_sigterm_is_ignored_while_the_server_lives_and_kills_once_it_is_gone(tmp_path):
    stand_in = tmp_path / "engine_stand_in.py"
    stand_in.write_text(ENGINE_STAND_IN)
    alive = subprocess.Popen([sys.executable, str(stand_in)], stdout=subprocess.PIPE, text=True, env=_env())
    try:
        assert alive.stdout.readline().startswith("ready")
        alive.send_signal(signal.SIGTERM)
        assert "SIGTERM ignored" in alive.stdout.readline()  # handled, not pending
        assert alive.poll() is None
    finally:
        alive.kill()
        alive.wait(10)

    parent = tmp_path / "orphaning_parent.py"
    parent.write_text(ORPHANING_PARENT)
    out = subprocess.run([sys.executable, str(parent), str(stand_in)], capture_output=True, text=True, env=_env(),
                         timeout=120)
    orphan = int(out.stdout.split()[1])
    try:
        os.kill(orphan, signal.SIGTERM)
        assert _until(lambda: _gone(orphan), 15), "an engine process whose server is gone survived SIGTERM"
    finally:
        if not _gone(orphan):
            os.kill(orphan, signal.SIGKILL)


LEFT_RUNNING = """
import types
from slora_jax.serve.engine_client import EngineClient


class Idle:
    cfg = types.SimpleNamespace(vocab_size=50, eos_token_id=2)
    ecfg = types.SimpleNamespace(max_model_len=64)

    def adapter_names(self):
        return []

    def has_unfinished(self):
        return False


def idle():
    return Idle(), {}


if __name__ == "__main__":
    client = EngineClient.launch(idle, (), log_level="error")
    print("child", client.pid, flush=True)
    # and exit without client.stop()
"""


def test_an_interpreter_that_exits_without_stopping_its_engine_process_still_exits(tmp_path):
    """multiprocessing SIGTERMs a daemon child at exit and joins it with no timeout: the engine process, which
    ignores that SIGTERM, must have been told to stop first."""
    script = tmp_path / "left_running.py"
    script.write_text(LEFT_RUNNING)
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=_env())
    try:
        out, _ = proc.communicate(timeout=60)
        child = int(re.search(r"child (\d+)", out).group(1))
        assert proc.returncode == 0, out
        assert _until(lambda: _gone(child), 15)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
