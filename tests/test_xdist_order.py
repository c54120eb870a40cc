"""The GPU suite's queue (tests/xdist_order.py): which tests share a worker, and that the longest go first."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import xdist_order


def _item(nodeid: str, *scopes: str):
    defs = {f"fx{i}": [SimpleNamespace(scope=s)] for i, s in enumerate(scopes)}
    marks = []
    return SimpleNamespace(nodeid=nodeid, _fixtureinfo=SimpleNamespace(name2fixturedefs=defs), marks=marks,
                           add_marker=marks.append)


@pytest.fixture
def costs(tmp_path, monkeypatch):
    def write(seconds: dict, rest: dict):
        path = tmp_path / "costs.json"
        path.write_text(json.dumps({"run": "test", "seconds": seconds, "rest": rest}))
        monkeypatch.setattr(xdist_order, "COSTS", path)
    return write


def test_long_tests_without_module_fixtures_go_alone_and_the_longest_group_goes_first(costs):
    costs({"a.py::shared_long": 40.0, "a.py::alone_long": 30.0, "b.py::alone_long": 90.0, "c.py::x": 2.0},
          {"a.py": 3.0, "c.py": 0.6})
    items = [_item("a.py::shared_long", "module", "session"), _item("a.py::alone_long", "session", "function"),
             _item("a.py::quick1"), _item("a.py::quick2"), _item("a.py::quick3"),
             _item("b.py::alone_long"), _item("c.py::x", "class"), _item("c.py::y"), _item("d.py::new")]
    seconds = xdist_order.recorded_seconds(items)
    assert seconds["a.py::quick1"] == pytest.approx(1.0)  # the file's 3 s under a second, shared by its 3 unnamed
    assert seconds["d.py::new"] == xdist_order.DEFAULT_S  # a file the run did not have
    assert seconds["c.py::y"] == pytest.approx(0.6)
    queue = xdist_order.groups(items, seconds)
    assert [(name, round(s, 1)) for name, s, _ in queue] == [
        ("b.py::alone_long", 90.0), ("a.py", 43.0), ("a.py::alone_long", 30.0), ("c.py", 2.6), ("d.py", 0.3)]
    assert [i.nodeid for i in queue[1][2]] == ["a.py::shared_long", "a.py::quick1", "a.py::quick2", "a.py::quick3"]
    xdist_order.order_for_xdist(items)
    assert [i.nodeid for i in items][:2] == ["b.py::alone_long", "a.py::shared_long"]
    assert {m.args[0] for i in items for m in i.marks} == {name for name, _, _ in queue}
    assert all(m.args[0] == "a.py" for m in items[1].marks)


def test_without_a_recorded_run_every_test_counts_the_default_and_files_stay_whole(costs, tmp_path, monkeypatch):
    monkeypatch.setattr(xdist_order, "COSTS", tmp_path / "missing.json")
    items = [_item("a.py::t1"), _item("a.py::t2"), _item("b.py::t1")]
    queue = xdist_order.groups(items, xdist_order.recorded_seconds(items))
    assert [(name, len(tests)) for name, _, tests in queue] == [("a.py", 2), ("b.py", 1)]


def test_the_recorded_run_names_tests_that_exist():
    """The committed costs file still matches the suite: most of its named seconds belong to tests collected now
    (a renamed test only loses its place in the queue, but a file gone stale orders nothing)."""
    recorded = json.loads(xdist_order.COSTS.read_text())
    assert recorded["seconds"] and recorded["rest"]
    root = Path(__file__).parent.parent
    files = {k.split("::")[0] for k in recorded["seconds"]}
    assert sum((root / f).exists() for f in files) >= 0.9 * len(files)


def test_files_that_share_steps_run_as_one_group_in_their_order(costs):
    costs({"tests/test_server.py::a": 9.0, "tests/test_server_load.py::b": 30.0}, {})
    items = [_item("tests/test_server_load.py::b"), _item("tests/test_other.py::c"), _item("tests/test_server.py::a")]
    queue = xdist_order.groups(items, xdist_order.recorded_seconds(items))
    assert [(name, [i.nodeid for i in tests]) for name, _, tests in queue][0] == (
        "tests/test_server.py", ["tests/test_server.py::a", "tests/test_server_load.py::b"])  # not alone: with its file


def test_shared_steps_name_files_whose_engines_are_equal():
    """The companions must still compile the same steps, else keeping them together only lengthens one worker."""
    import test_logprobs
    import test_penalties
    assert test_logprobs.ECFG == test_penalties.ECFG
    root = Path(__file__).parent.parent
    for files in xdist_order.SHARED_STEPS:
        assert all((root / f).exists() for f in files), files
