"""Read an offline W&B run file (``run-<id>.wandb``) back into protobuf records.

wandb 0.31 ships no Python reader, so this follows the file's LevelDB-log layout: a 7-byte header
(``:W&B``, magic, version), then 32 KiB blocks of records, each with a 7-byte header (CRC32, length, type)
and split into FIRST/MIDDLE/LAST pieces when it crosses a block.
"""

from __future__ import annotations

import json
import struct
import time
from pathlib import Path

from wandb.proto import wandb_internal_pb2

BLOCK = 32768
HEADER = 7
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def read_records(path: str | Path) -> list[wandb_internal_pb2.Record]:
    data = Path(path).read_bytes()
    ident, _magic, _version = struct.unpack("<4sHB", data[:HEADER])
    assert ident == b":W&B", f"{path} is not a W&B run file"
    records, pending, offset = [], b"", HEADER
    while offset + HEADER <= len(data):
        left_in_block = BLOCK - offset % BLOCK
        if left_in_block < HEADER:  # the rest of a block too short for a header is zero padding
            offset += left_in_block
            continue
        _crc, length, kind = struct.unpack("<IHB", data[offset : offset + HEADER])
        if kind == 0 and length == 0:
            break
        piece = data[offset + HEADER : offset + HEADER + length]
        offset += HEADER + length
        if kind == FULL:
            pending = b""
            chunks = [piece]
        elif kind == FIRST:
            pending = piece
            continue
        elif kind == MIDDLE:
            pending += piece
            continue
        else:  # LAST
            chunks, pending = [pending + piece], b""
        record = wandb_internal_pb2.Record()
        record.ParseFromString(chunks[0])
        records.append(record)
    return records


def history_and_config(path: str | Path) -> tuple[list[dict], dict]:
    """Logged history rows and the config of a run file (values decoded from JSON)."""
    history, config = [], {}
    for record in read_records(path):
        kind = record.WhichOneof("record_type")
        if kind == "history":
            items = record.history.item
            history.append({item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in items})
        elif kind == "config":
            for item in record.config.update:
                config[item.key or "/".join(item.nested_key)] = json.loads(item.value_json)
        elif kind == "run":
            for item in record.run.config.update:
                config[item.key or "/".join(item.nested_key)] = json.loads(item.value_json)
    return history, config


def summary_of(path: str | Path) -> dict:
    """The run's summary as its file leaves it: every update in order, the last value of a key winning (nested keys
    joined by ``/``)."""
    summary = {}
    for record in read_records(path):
        if record.WhichOneof("record_type") == "summary":
            for item in record.summary.update:
                summary[item.key or "/".join(item.nested_key)] = json.loads(item.value_json)
    return summary


def finished_records(path: str | Path, timeout_s: float = 60.0) -> list[wandb_internal_pb2.Record]:
    """The records of a run file once it holds the run's end (its ``exit`` record): W&B's service process, not the
    process that logged, writes the file, and may still be writing it after ``finish`` has returned."""
    deadline = time.monotonic() + timeout_s
    while True:
        records = read_records(path) if Path(path).is_file() and Path(path).stat().st_size >= HEADER else []
        if any(r.WhichOneof("record_type") == "exit" for r in records) or time.monotonic() > deadline:
            return records
        time.sleep(0.5)
