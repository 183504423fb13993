"""JSON records that carry a checksum of their own content: manifests and chunk indexes.

A record is sealed by adding ``"checksum": "sha256:<hex>"``, the SHA-256 of the record's canonical
form (the other keys, sorted, compact separators), so the check does not depend on how the file was
indented. Reading unseals: the checksum is removed and recomputed, and a record whose content does
not match, or that lacks a checksum where its version requires one, raises `DamagedRecord` naming
the file. A changed digit of a reader position, a step or a file size is caught that way; the HDF5
files are covered by the whole-file CRC32 the manifest records, by their own block checksums and by
the digest of their attributes each file keeps in ``/_attrs`` (`store.attr_digest`).
Local: nothing here uses MPI.
"""
from __future__ import annotations

import hashlib
import json

CHECKSUM_KEY = "checksum"
PREFIX = "sha256:"


class DamagedRecord(ValueError):
    """A manifest or index whose content fails its checksum (or cannot be parsed)."""

    def __init__(self, path: str, reason: str):
        super().__init__(f"{path}: {reason}")
        self.path, self.reason = path, reason


def content_checksum(record: dict) -> str:
    """'sha256:<hex>' of `record` without its checksum key, in canonical JSON. Local."""
    return _checksum_of(_canonical(record))


def _canonical(record: dict) -> str:
    """`record` without its checksum key as canonical JSON: keys sorted, compact separators."""
    body = {k: v for k, v in record.items() if k != CHECKSUM_KEY}
    return json.dumps(body, sort_keys=True, separators=(",", ":"), allow_nan=True)


def _checksum_of(canonical: str) -> str:
    return PREFIX + hashlib.sha256(canonical.encode()).hexdigest()


def seal(record: dict) -> dict:
    """A copy of `record` with its checksum added. Local."""
    out = {k: v for k, v in record.items() if k != CHECKSUM_KEY}
    out[CHECKSUM_KEY] = content_checksum(out)
    return out


def unseal(record: dict, path: str, required: bool) -> dict:
    """`record` without its checksum, after checking it; DamagedRecord naming `path` when the
    content does not match, or when there is no checksum and `required`. Local."""
    if not isinstance(record, dict):
        raise DamagedRecord(path, f"expected a JSON object, found {type(record).__name__}")
    stored = record.get(CHECKSUM_KEY)
    if stored is None:
        if required:
            raise DamagedRecord(path, "no checksum (damaged: this version of the file is always "
                                      "written with one)")
        return dict(record)
    if stored != content_checksum(record):
        raise DamagedRecord(path, "content fails its checksum (damaged or edited after it was "
                                  "committed)")
    return {k: v for k, v in record.items() if k != CHECKSUM_KEY}


def read_sealed(path: str, version_key: str, first_sealed_version: int) -> dict:
    """Parse and unseal the record at `path`; a checksum is required from `first_sealed_version`
    on (older files predate checksums). DamagedRecord naming the file on any problem. Local."""
    try:
        with open(path, "rb") as f:
            record = json.loads(f.read().decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as e:
        raise DamagedRecord(path, f"not valid JSON (damaged): {e}") from None
    version = record.get(version_key, 1) if isinstance(record, dict) else None
    required = not isinstance(version, int) or version >= first_sealed_version
    return unseal(record, path, required)


def dumps_sealed(record: dict, indent: int | None = None) -> str:
    """The sealed record as JSON text: laid out with sorted keys when `indent` is given (a
    manifest, read by people), else the canonical form with the checksum put in front, which
    encodes the record once instead of twice (a chunk index of thousands of chunks, written at
    every ingestion). Readers do not mind the order of keys. Local."""
    if indent is not None:
        return json.dumps(seal(record), indent=indent, sort_keys=True, allow_nan=True)
    body = _canonical(record)
    head = f"{{{json.dumps(CHECKSUM_KEY)}:{json.dumps(_checksum_of(body))}"
    return head + ("}" if body == "{}" else "," + body[1:])
