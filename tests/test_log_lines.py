import subprocess
import sys

from ae.log_lines import (
    BAD_SAMPLE,
    BAD_SHARD_READ,
    DATA_ERRORS,
    MARKER,
    RECORD_PATTERN,
    TRAIN_STEP,
    epoch_marker,
)
from tests.support.runs import ROOT


def test_formats_round_trip() -> None:
    line = TRAIN_STEP.format(step=12, loss="0.5", detail=", lr=0.001, 100 samples/s")
    assert TRAIN_STEP.parse(line) == {
        "step": "12",
        "loss": "0.5",
        "detail": ", lr=0.001, 100 samples/s",
    }
    assert MARKER.parse(epoch_marker(3, "TRAINING", "END")) == {
        "name": "EPOCH 3 TRAINING",
        "edge": "END",
    }


def test_record_pattern_reads_what_the_sinks_write(tmp_path) -> None:
    code = (
        "from pathlib import Path; import logging_cfg; from loguru import logger\n"
        f"ctx = logging_cfg.RankContext(rank=1, world_size=2)\n"
        f"logging_cfg.configure(Path({str(tmp_path)!r}), 'TS', ctx)\n"
        "logger.info('hello there')\n"
    )
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True)
    (line,) = (tmp_path / "debug_rank1_TS.log").read_text().splitlines()
    m = RECORD_PATTERN.match(line)
    assert m and m["level"] == "INFO" and m["rank"] == "1" and m["world"] == "2"
    assert m["message"] == "hello there" and m["worker"] is None


def test_data_lines_round_trip() -> None:
    """The bad-data lines name the shard even when its URL has spaces (pipe:) or colons."""
    line = BAD_SAMPLE.format(key="00000016", url="pipe:cat /d/a b.tar", reason="cannot decode: x")
    assert "shard" in line
    assert BAD_SAMPLE.parse(line) == {
        "key": "00000016",
        "url": "pipe:cat /d/a b.tar",
        "reason": "cannot decode: x",
    }
    line = BAD_SHARD_READ.format(
        url="https://h/a.tar", reason="ReadError: end (x)", key="-", lost=6, planned=10
    )
    assert BAD_SHARD_READ.parse(line) == {
        "url": "https://h/a.tar",
        "reason": "ReadError: end (x)",
        "key": "-",
        "lost": "6",
        "planned": "10",
    }
    summary = DATA_ERRORS.format(split="val", bad_samples=1, bad_shards=0, replaced=1)
    assert DATA_ERRORS.parse(summary)["split"] == "val"
