"""`surojax tokenize` reports each dataset in a sentence, not a raw dict; the data summary is printed by the
trainer only (build_data does not log it too)."""
import logging
import re

from surojax.cli.main import main
from surojax.data.pipeline import build_data
from surojax.data.tokenizer import Tokenizer

from tests.cli.test_train_commands import BASE, _config


def test_tokenize_prints_one_readable_line_per_dataset(tmp_path, capsys):
    assert main(["tokenize", str(_config(tmp_path))]) == 0
    out = capsys.readouterr().out
    assert "{" not in out and "'path'" not in out
    lines = [x.strip() for x in out.splitlines() if "inst.jsonl" in x]
    assert len(lines) == 1, out
    assert re.fullmatch(rf"{re.escape(str(tmp_path / 'inst.jsonl'))} \(split train\): instruction \(set in the "
                        r"config\); \d+ rows read, 0 skipped as invalid, \d+ examples", lines[0]), lines[0]


def test_build_data_does_not_log_the_summary(tmp_path, caplog):
    config = _config(tmp_path)  # writes inst.jsonl
    with caplog.at_level(logging.INFO):
        data = build_data([tmp_path / "inst.jsonl"], Tokenizer.from_dir(BASE), sequence_len=64, batch_size=2,
                          process_index=0, process_count=1)
    assert config.is_file() and data.stats.examples > 0
    assert not [r for r in caplog.records if data.stats.summary() in r.getMessage()]
