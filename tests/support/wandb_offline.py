"""Reading an offline W&B run back (`<run>.wandb`), for tests: wandb writes it from its Go core
and ships no Python reader, so the framing is read here. The file is a LevelDB-style log: a
7-byte header (`:W&B`, magic 0xBEE1, version), then 32 KiB blocks of records, each with a 7-byte
header (CRC32, length, type: 1 full, 2 first, 3 middle, 4 last); a block's tail under 7 bytes
is padding. Each record is a `wandb_internal_pb2.Record` protobuf."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

BLOCK = 32 * 1024
HEADER = 7


def _payloads(data: bytes) -> Iterator[bytes]:
    pos, parts = HEADER, b""
    while pos + HEADER <= len(data):
        left = BLOCK - pos % BLOCK
        if left < HEADER:
            pos += left
            continue
        length = int.from_bytes(data[pos + 4 : pos + 6], "little")
        kind = data[pos + 6]
        chunk = data[pos + HEADER : pos + HEADER + length]
        pos += HEADER + length
        if kind == 0 and length == 0:
            continue  # zero padding at a block's end
        parts = chunk if kind in (1, 2) else parts + chunk
        if kind in (1, 4):
            yield parts
            parts = b""


def read_offline_run(path: Path) -> tuple[str | None, list[dict[str, Any]]]:
    """(run id, history rows as {key: value}) of an offline run's `.wandb` file."""
    from wandb.proto import wandb_internal_pb2 as pb

    run_id, rows = None, []
    for payload in _payloads(path.read_bytes()):
        rec = pb.Record()
        rec.ParseFromString(payload)
        kind = rec.WhichOneof("record_type")
        if kind == "run":
            run_id = rec.run.run_id
        elif kind == "history":
            rows.append(
                {(i.key or "/".join(i.nested_key)): json.loads(i.value_json)
                 for i in rec.history.item}
            )  # fmt: skip
    return run_id, rows
