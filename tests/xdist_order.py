"""The suite's work queue under pytest-xdist ``--dist loadgroup`` (`.ci/gpu-suite`'s 14 workers, CI's 2): which
tests run together on one worker, and in what order the groups are handed out. A run without xdist is left as
collected.

Groups: a test file is one group, so its module fixtures (warmed engines, servers) are built once (files whose
engines compile the same steps share one: ``SHARED_STEPS``); a test that uses no fixture wider than a function
(session fixtures are built once per worker anyway) and took ``SOLO_S`` or more in the recorded run is a group of
its own, so long single tests spread over the workers instead of queueing behind their file.

Order: longest first (the classic longest-processing-time rule), by the seconds each test took in the recorded run
(``gpu_suite_costs.json``, written by ``benchmarks/h200/summary.py costs``: the tests of a second or more by name,
the rest as seconds per file, shared here among the file's tests not named; a file it does not know counts
``DEFAULT_S`` a test). xdist hands each worker its next group while the last two tests of the current one run, so a
long group queued late would end the run alone: the queue's tail must be the short groups.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

COSTS = Path(__file__).with_name("gpu_suite_costs.json")
SOLO_S = 5.0  # a test this long, needing no module fixture, is worth a group (and a worker's session setup) alone
DEFAULT_S = 0.3  # a test of a file the recorded run did not have
_SHARED_SCOPES = ("module", "class", "package")
# Files whose engines compile the same steps (equal shapes), kept on one worker in this order: the first compiles, the
# rest take its steps from the run-wide compilation cache (tests/conftest.py). On different workers they compile at
# the same time and both miss. Found with the compile ledger on the CPU box, files run in one process (session 12):
# test_penalties took 8 of its 8 step compiles from test_logprobs' (the same ECFG, checked by
# tests/test_xdist_order.py); test_server_load 7 of 10, test_adapter_mixes 4 of 11 and test_stream_handoff 2 of 2 from
# test_server's (server_fixtures' default engine). On the H200 the penalties file's 6 steps took 117 compile-seconds.
SHARED_STEPS = (("tests/test_logprobs.py", "tests/test_penalties.py"),
                ("tests/test_server.py", "tests/test_server_load.py", "tests/test_adapter_mixes.py",
                 "tests/test_stream_handoff.py"))


def recorded_seconds(items: list) -> dict[str, float]:
    """Each test's seconds in the recorded run, estimated as above."""
    try:
        recorded = json.loads(COSTS.read_text())
        named, rest = dict(recorded["seconds"]), dict(recorded["rest"])
    except (OSError, ValueError, KeyError, TypeError):
        named, rest = {}, {}
    unnamed: dict[str, int] = {}
    for item in items:
        if item.nodeid not in named:
            file = item.nodeid.split("::")[0]
            unnamed[file] = unnamed.get(file, 0) + 1
    out = {}
    for item in items:
        file = item.nodeid.split("::")[0]
        if item.nodeid in named:
            out[item.nodeid] = float(named[item.nodeid])
        elif file in rest:
            out[item.nodeid] = float(rest[file]) / unnamed[file]
        elif not any(k.startswith(file + "::") for k in named):
            out[item.nodeid] = DEFAULT_S
        else:
            out[item.nodeid] = 0.0  # a file whose every recorded test is named: a test new since then
    return out


def shares_fixtures(item) -> bool:
    """Whether the test uses a fixture built once for its module, class or package (then it stays with its file)."""
    info = getattr(item, "_fixtureinfo", None)
    if info is None:
        return True
    return any(getattr(d, "scope", "function") in _SHARED_SCOPES
               for defs in info.name2fixturedefs.values() for d in defs)


def groups(items: list, seconds: dict[str, float]) -> list[tuple[str, float, list]]:
    """(group name, recorded seconds, its tests in collection order), longest first; ties keep collection order."""
    together = {file: files[0] for files in SHARED_STEPS for file in files}
    rank = {file: i for files in SHARED_STEPS for i, file in enumerate(files)}
    out: dict[str, list] = {}
    for item in sorted(items, key=lambda i: rank.get(i.nodeid.split("::")[0], 0)):  # stable: a file's order kept
        file = item.nodeid.split("::")[0]
        cost = seconds.get(item.nodeid, 0.0)
        solo = cost >= SOLO_S and not shares_fixtures(item) and file not in together
        out.setdefault(item.nodeid if solo else together.get(file, file), []).append(item)
    costed = [(name, sum(seconds.get(i.nodeid, 0.0) for i in tests), tests) for name, tests in out.items()]
    return sorted(costed, key=lambda g: -g[1])


def order_for_xdist(items: list) -> None:
    """Mark each test with its group and reorder ``items`` into the queue (xdist keeps it: tests/conftest.py turns
    off its own reordering)."""
    queue = groups(items, recorded_seconds(items))
    items[:] = [item for _, _, tests in queue for item in tests]
    for name, _, tests in queue:
        for item in tests:
            item.add_marker(pytest.mark.xdist_group(name))
