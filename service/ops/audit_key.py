"""The audit signing key: lives with the service, never in the database.

`TASKLEDGER_AUDIT_KEY` names a PEM file (PKCS#8 Ed25519 private key); without
it the key is `audit-ed25519.pem` under the data dir, created on first use
(mode 0600). Replicas must share one key: a checkpoint signed by another key
fails verification against the published one.
"""

from __future__ import annotations

import os
from pathlib import Path

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.hazmat.primitives.serialization import (
    Encoding,
    NoEncryption,
    PrivateFormat,
    load_pem_private_key,
)

from taskledger.service.settings import Settings

DEFAULT_NAME = "audit-ed25519.pem"


def key_path(settings: Settings) -> Path:
    return Path(settings.audit_key) if settings.audit_key else Path(settings.data_dir) / DEFAULT_NAME


def load_or_create(settings: Settings) -> Ed25519PrivateKey:
    path = key_path(settings).expanduser()
    if not path.exists():
        if settings.audit_key:
            raise FileNotFoundError(f"TASKLEDGER_AUDIT_KEY names {path}, which does not exist")
        path.parent.mkdir(parents=True, exist_ok=True)
        pem = Ed25519PrivateKey.generate().private_bytes(Encoding.PEM, PrivateFormat.PKCS8, NoEncryption())
        tmp = path.with_name(f".{path.name}.{os.getpid()}")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(pem)
        try:
            os.link(tmp, path)  # atomic, and never over a key another replica made first
        except FileExistsError:
            pass
        finally:
            tmp.unlink()
    key = load_pem_private_key(path.read_bytes(), password=None)
    if not isinstance(key, Ed25519PrivateKey):
        raise ValueError(f"{path} holds a {type(key).__name__}, not an Ed25519 private key")
    return key
