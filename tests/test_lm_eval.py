"""lm-evaluation-harness scores adapters through the server: ``local-completions`` (echo + logprobs, max_tokens 1)
over two small tasks written here (a ``loglikelihood`` task and a ``multiple_choice`` task over local jsonl files),
and every loglikelihood it computed equals HF PEFT's (fp32) on the same token ids, for an adapter and the base model.

lm_eval runs in a subprocess with the Hugging Face libraries offline (its tokenizer is the served model dir's own), so
nothing is downloaded and its global state (logging, caches) stays out of the test process. The subprocess records
what each API call scored (the exact token ids, the context length and lm_eval's parsed result) next to the samples
of ``simple_evaluate``, and the test recomputes each with PEFT.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch
from hf_reference import hf_model
from peft import PeftModel
from server_fixtures import BASE_NAME, start_server

pytest.importorskip("lm_eval")

LL_TASK, MC_TASK = "slora_tiny_ll", "slora_tiny_mc"
QUESTIONS = [
    ("The quick brown fox jumps over the", ["lazy dog", "moon", "red car tonight"], 0),
    ("Once upon a time there was a", ["king", "small village by the sea", "number"], 1),
    ("Numbers: one two three", ["four", "five six", "seven"], 0),
    ("The weather today is", ["sunny and warm", "a language model", "cold"], 2),
]
CONTINUATIONS = [("Hello, how are you", " today?"), ("Please summarise the following", " text for me"),
                 ("A language model predicts the next", " token")]

RUNNER = textwrap.dedent('''
    import json, sys
    import lm_eval
    from lm_eval.models.openai_completions import LocalCompletionsAPI
    from lm_eval.tasks import TaskManager

    base_url, tokenizer, task_dir, out, tasks = sys.argv[1:6]
    models = sys.argv[6:]
    calls = []
    parse = LocalCompletionsAPI.parse_logprobs

    def recording(outputs, tokens=None, ctxlens=None, **kwargs):
        result = parse(outputs=outputs, tokens=tokens, ctxlens=ctxlens, **kwargs)
        calls.append({"tokens": tokens, "ctxlens": ctxlens, "result": result})
        return result

    LocalCompletionsAPI.parse_logprobs = staticmethod(recording)
    report = {}
    for model in models:
        calls.clear()
        res = lm_eval.simple_evaluate(
            model="local-completions", tasks=tasks.split(","), task_manager=TaskManager(include_path=task_dir),
            model_args={"model": model, "base_url": base_url, "tokenizer_backend": "huggingface",
                        "tokenizer": tokenizer, "num_concurrent": 1, "max_retries": 1, "timeout": 600},
            log_samples=True, bootstrap_iters=0, random_seed=0, numpy_random_seed=0, torch_random_seed=0)
        report[model] = {
            "calls": list(calls),
            "results": {t: {k: v for k, v in r.items() if isinstance(v, (int, float))}
                        for t, r in res["results"].items()},
            "samples": {t: [{"resps": s["filtered_resps"], "target": s["target"]} for s in samples]
                        for t, samples in res["samples"].items()},
        }
    json.dump(report, open(out, "w"), default=lambda o: o.item() if hasattr(o, "item") else str(o))
''')


def _write_tasks(task_dir) -> None:
    task_dir.mkdir()
    mc = task_dir / "mc.jsonl"
    mc.write_text("".join(json.dumps({"question": q, "choices": c, "answer": a}) + "\n" for q, c, a in QUESTIONS))
    ll = task_dir / "ll.jsonl"
    ll.write_text("".join(json.dumps({"context": c, "continuation": t}) + "\n" for c, t in CONTINUATIONS))
    common = "dataset_path: json\ntest_split: test\n"
    (task_dir / f"{MC_TASK}.yaml").write_text(
        f"task: {MC_TASK}\n{common}dataset_kwargs:\n  data_files:\n    test: {mc}\noutput_type: multiple_choice\n"
        "doc_to_text: '{{question}}'\ndoc_to_choice: '{{choices}}'\ndoc_to_target: '{{answer}}'\n"
        "metric_list:\n  - metric: acc\n")
    (task_dir / f"{LL_TASK}.yaml").write_text(
        f"task: {LL_TASK}\n{common}dataset_kwargs:\n  data_files:\n    test: {ll}\noutput_type: loglikelihood\n"
        "doc_to_text: '{{context}}'\ndoc_to_target: '{{continuation}}'\ntarget_delimiter: ''\n"
        "metric_list:\n  - metric: perplexity\n  - metric: acc\n")


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    server = start_server(tmp_path_factory.mktemp("lm_eval"), n_adapters=2)
    yield server
    server.stop()


def _peft_scores(model, calls) -> list[tuple[float, bool]]:
    """PEFT's (sum of continuation logprobs, all continuation tokens greedy) for each request lm_eval sent."""
    scores = []
    for call in calls:
        for tokens, ctxlen in zip(call["tokens"], call["ctxlens"], strict=True):
            with torch.no_grad():
                logits = model(torch.tensor([tokens])).logits[0].double()
            logp = torch.log_softmax(logits, dim=-1).numpy()
            cont = range(ctxlen, len(tokens))
            scores.append((float(sum(logp[i - 1, tokens[i]] for i in cont)),
                           all(int(np.argmax(logp[i - 1])) == tokens[i] for i in cont)))
    return scores


def test_lm_eval_loglikelihoods_equal_peft(srv, tmp_path):
    _write_tasks(tmp_path / "tasks")
    (tmp_path / "runner.py").write_text(RUNNER)
    adapter = srv.adapters[1]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "HF_HOME": str(tmp_path / "hf"), "TOKENIZERS_PARALLELISM": "false"}
    out = tmp_path / "report.json"
    proc = subprocess.run([sys.executable, str(tmp_path / "runner.py"), srv.base_url + "/completions",
                           str(srv.model_dir), str(tmp_path / "tasks"), str(out), f"{LL_TASK},{MC_TASK}",
                           BASE_NAME, adapter],
                          env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    report = json.loads(out.read_text())
    n_requests = len(CONTINUATIONS) + sum(len(c) for _, c, _ in QUESTIONS)
    for name, adapter_dir in ((BASE_NAME, None), (adapter, srv.adapter_dir / adapter)):
        run = report[name]
        ours = [tuple(r) for call in run["calls"] for r in call["result"]]
        assert len(ours) == n_requests, name
        model = hf_model(srv.model_dir)
        if adapter_dir is not None:
            model = PeftModel.from_pretrained(model, str(adapter_dir)).eval()
        ref = _peft_scores(model, run["calls"])
        np.testing.assert_allclose([o[0] for o in ours], [r[0] for r in ref], rtol=1e-4, atol=1e-4, err_msg=name)
        assert [bool(o[1]) for o in ours] == [r[1] for r in ref], name
        # the harness scored its tasks from exactly these numbers
        scored = sorted(round(float(r[0]), 4) for t in (LL_TASK, MC_TASK) for s in run["samples"][t]
                        for r in s["resps"])
        assert scored == sorted(round(o[0], 4) for o in ours), name
        assert set(run["results"]) >= {LL_TASK, MC_TASK}
        assert "acc,none" in run["results"][MC_TASK] and "perplexity,none" in run["results"][LL_TASK]
    base_ll = [r[0] for call in report[BASE_NAME]["calls"] for r in call["result"]]
    adapter_ll = [r[0] for call in report[adapter]["calls"] for r in call["result"]]
    assert not np.allclose(base_ll, adapter_ll), "the adapter should change the scores"
    stats = srv.wait_idle()
    assert stats["pool"]["pages_kv"] == 0
