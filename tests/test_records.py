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
