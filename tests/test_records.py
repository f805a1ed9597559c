"""minitransformer.records: a run's records are read back through their schemas, and what
does not fit is one line naming the file, the line and what is wrong."""

import json
import logging

import pytest

from minitransformer import records


def test_a_damaged_log_line_is_named_or_dropped_with_a_warning(tmp_path, caplog):
    log = tmp_path / "train.jsonl"
    good = [{"kind": "start", "command": "x"}, {"kind": "train", "step": 1, "loss": 2.5}]
    log.write_text("".join(json.dumps(r) + "\n" for r in good) + 'null\n{"kind": "val"}\n{"kind": "tr')
    with pytest.raises(records.RecordError, match=r"train.jsonl, line 3: the content must be object \(got None\)"):
        records.read_log(log)
    with caplog.at_level(logging.WARNING, logger="minitransformer.records"):
        assert records.read_log(log, drop_damaged=True) == good
    assert "line 4: the content must contain ['step']" in caplog.text  # a val row without its step
    assert "line 5: not JSON" in caplog.text  # torn by a crash


@pytest.mark.parametrize("reader, text, message", [
    (records.read_result, '{"bleu": Infinity}', "not JSON .*Infinity"),
    (records.read_result, "[]", "the content must be object"),
    (records.read_sweep, '[{"first": "a", "last": "b", "average": 0, "beam": 4, "alpha": 1, "sentences": 9}]',
     r"\[0\].average must be bigger than or equal to 1"),
    (records.read_points, '{"points": {}}', "points must be array"),
    (records.read_points, "\xff", "not JSON"),
])
def test_each_record_is_refused_in_one_line(tmp_path, reader, text, message):
    path = tmp_path / "record.json"
    path.write_bytes(text.encode("latin-1"))
    with pytest.raises(records.RecordError, match="record.json: " + message) as e:
        reader(path)
    assert "\n" not in str(e.value)


def test_what_is_not_there_yet_is_empty(tmp_path):
    assert records.read_sweep(tmp_path / "none.json") == []
    assert records.read_points(tmp_path / "none.json") == {"points": []}


def git_checkout(folder):
    """A git repository at ``folder`` with one commit of one tracked file."""
    import subprocess

    def git(*args):
        subprocess.run(["git", "-C", str(folder), "-c", "user.name=t", "-c", "user.email=t@t", *args],
                       check=True, capture_output=True)

    folder.mkdir(exist_ok=True)
    git("init", "-q")
    (folder / "tracked.txt").write_text("one\n")
    git("add", "tracked.txt")
    git("commit", "-q", "-m", "one")
    return folder


def test_append_adds_a_whole_line_and_keeps_the_earlier_ones(tmp_path):
    repo = git_checkout(tmp_path / "repo")
    path = repo / "bench.jsonl"
    first = records.append(path, "python bench.py", {"device": "cpu"}, {"ours_ms": 1.5}, note="quiet")
    second = records.append(path, "python bench.py --fast", {"device": "cpu"}, {"ours_ms": 1.25})
    assert path.read_text().endswith("\n") and len(path.read_text().splitlines()) == 2
    assert records.read_bench(path) == [first, second]
    assert first["note"] == "quiet" and "note" not in second
    assert first["commit"] == second["commit"] and "+dirty" not in first["commit"]  # an untracked record is clean
    assert first["machine"] and first["date"][:2] == "20"


def test_the_commit_is_dirty_when_tracked_files_differ(tmp_path):
    repo = git_checkout(tmp_path / "repo")
    (repo / "tracked.txt").write_text("two\n")
    row = records.append(repo / "bench.jsonl", "python bench.py", {}, {"x": 1})
    assert row["commit"].endswith("+dirty")


def test_the_commit_is_the_checkout_measured_not_the_records_folder(tmp_path):
    repo = git_checkout(tmp_path / "repo")
    elsewhere = tmp_path / "records"  # not a git checkout
    elsewhere.mkdir()
    with pytest.raises(records.RecordError, match="not a git checkout"):
        records.append(elsewhere / "bench.jsonl", "python bench.py", {}, {"x": 1})
    row = records.append(elsewhere / "bench.jsonl", "python bench.py", {}, {"x": 1}, checkout=repo)
    assert records.read_bench(elsewhere / "bench.jsonl") == [row]


def test_a_copy_without_git_is_named_by_the_commit_its_sender_gives(tmp_path, monkeypatch):
    copy = tmp_path / "copy"  # a checkout sent to a GPU machine without its .git
    copy.mkdir()
    monkeypatch.setenv("MT_RECORD_COMMIT", "1057ee6+dirty")
    assert records.append(copy / "bench.jsonl", "python bench.py", {}, {"x": 1})["commit"] == "1057ee6+dirty"
    monkeypatch.setenv("MT_RECORD_COMMIT", "not a commit")
    with pytest.raises(records.RecordError, match="commit"):
        records.append(copy / "bench.jsonl", "python bench.py", {}, {"x": 1})


@pytest.mark.parametrize("figures", [{}, {"x": float("nan")}, {"x": float("inf")}, {"x": [1]}])
def test_a_line_that_would_not_read_back_is_not_written(tmp_path, figures):
    repo = git_checkout(tmp_path / "repo")
    path = repo / "bench.jsonl"
    kept = records.append(path, "python bench.py", {}, {"x": 1})
    with pytest.raises(records.RecordError, match="bench.jsonl: the new line"):
        records.append(path, "python bench.py", {}, figures)
    assert records.read_bench(path) == [kept]


@pytest.mark.parametrize("line, message", [
    ("{not json", "not JSON"),
    ('{"date": "2026-12-07"}', "must contain"),
    (json.dumps({"date": "2026-12-07", "commit": "abc1234", "machine": "m", "command": "c", "config": {},
                 "figures": {"x": 1}, "extra": 1}), "must not contain"),
    (json.dumps({"date": "7 Dec", "commit": "abc1234", "machine": "m", "command": "c", "config": {},
                 "figures": {"x": 1}}), "date"),
])
def test_a_malformed_bench_line_is_refused_naming_the_file_and_line(tmp_path, line, message):
    good = {"date": "2026-12-07", "commit": "abc1234+dirty", "machine": "m", "command": "c", "config": {"a": "b"},
            "figures": {"x": 1.5}}
    path = tmp_path / "bench.jsonl"
    path.write_text(json.dumps(good) + "\n" + line + "\n")
    with pytest.raises(records.RecordError, match=f"bench.jsonl, line 2: .*{message}") as e:
        records.read_bench(path)
    assert "\n" not in str(e.value)
    path.write_text(json.dumps(good) + "\n")
    assert records.read_bench(path) == [good]


def test_record_names_the_command_and_rounds_the_figures(tmp_path, monkeypatch):
    repo = git_checkout(tmp_path / "repo")
    script = repo / "benchmarks" / "bench.py"
    script.parent.mkdir()
    monkeypatch.setenv("MT_RECORDS_DIR", str(tmp_path))
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    path = records.record(script, ["--name", "a b"], {"device": "cpu"}, {"ms": 1.23456789, "n": 3}, ranks=2)
    assert path == tmp_path / "bench.jsonl"
    (row,) = records.read_bench(path)
    assert row["command"] == "OMP_NUM_THREADS=2 mpiexec -n 2 python benchmarks/bench.py --name 'a b'"
    assert row["figures"] == {"ms": 1.235, "n": 3} and row["config"] == {"device": "cpu"}
    assert row["commit"] == records.append(repo / "x.jsonl", "c", {}, {"x": 1})["commit"]
    monkeypatch.delenv("MT_RECORDS_DIR")
    monkeypatch.delenv("OMP_NUM_THREADS")
    assert records.record(script, [], {}, {"x": 1}) == repo / "benchmarks" / "records" / "bench.jsonl"
    (row,) = records.read_bench(repo / "benchmarks" / "records" / "bench.jsonl")
    assert row["command"] == "python benchmarks/bench.py"
