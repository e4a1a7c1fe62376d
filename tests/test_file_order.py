"""The suite's file order (tests/file_order.py): unseen files first, then the longest, each file's
tests in their own order; a run's seconds are merged into the last run's record."""

from types import SimpleNamespace

import file_order


def items(*ids):
    return [SimpleNamespace(nodeid=i) for i in ids]


def test_longest_files_first_and_unseen_ones_before_them():
    got = file_order.longest_first(
        items("a.py::t1", "b.py::t1", "a.py::t2", "c.py::t1", "d.py::t1"), {"a.py": 1.0, "b.py": 5.0, "c.py": 3.0}
    )
    assert [i.nodeid for i in got] == ["d.py::t1", "b.py::t1", "c.py::t1", "a.py::t1", "a.py::t2"]


def test_seconds_are_summed_per_file_and_merged_into_the_record(tmp_path, monkeypatch):
    monkeypatch.setattr(file_order, "record_path", lambda: tmp_path / "seconds.json")
    (tmp_path / "seconds.json").write_text('{"old.py": 7.0, "a.py": 100.0}')
    run = file_order.FileSeconds()
    for nodeid, duration in (("a.py::t1", 1.5), ("a.py::t2", 2.0), ("b.py::t1", 0.5)):
        run.add(SimpleNamespace(nodeid=nodeid, duration=duration))
    run.save()
    assert file_order.read() == {"a.py": 3.5, "b.py": 0.5, "old.py": 7.0}
    assert [p.name for p in tmp_path.iterdir()] == ["seconds.json"]  # no temporary left


def test_an_unreadable_record_is_no_order(tmp_path, monkeypatch):
    monkeypatch.setattr(file_order, "record_path", lambda: tmp_path / "seconds.json")
    (tmp_path / "seconds.json").write_text("{not json")
    assert file_order.read() == {}
