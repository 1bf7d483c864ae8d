"""Who is calling: API keys, each with a name and a tenant, for both front ends.

The same keys guard the HTTP API (``Authorization: Bearer <key>``) and gRPC (metadata
``authorization: Bearer <key>``; UNAUTHENTICATED otherwise); health checks and gRPC
reflection stay open (docs/security.md). A key's **name** says whose request it is (a
client may abort only its own, and quotas count per name); its **tenant** is what cache
isolation goes by (several keys may share one, and so their cached prefixes).

Keys come from a file (``router.api_keys_file``, YAML: a mounted Kubernetes Secret, say)
or the environment (``BATON_API_KEYS``), never the command line (argv is world-readable
in /proc). Keys are compared in constant time, against every key, so the time an answer
takes says nothing about how much of a key was right nor which key matched.
"""

from __future__ import annotations

import hmac
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

import yaml

ENV_KEYS = "BATON_API_KEYS"  # "name=key,name=key"; a name's tenant is the name
ENV_KEY = "BATON_API_KEY"  # one key, named "default"
MIN_KEY_LEN = 16  # shorter keys are refused at load: guessable


class AuthConfigError(ValueError):
    """The keys cannot be loaded; the message names the file or variable and the entry."""


@dataclass(frozen=True)
class Principal:
    """An authenticated caller."""

    name: str
    tenant: str


ANONYMOUS = Principal("", "")  # no keys configured: everyone is the same caller


class ApiKeys:
    """The configured keys; :meth:`authenticate` maps a credential to its principal."""

    def __init__(self, entries: Iterable[tuple[str, Principal]]):
        self._entries = [(key.encode(), principal) for key, principal in entries]
        names = [p.name for _, p in self._entries]
        if len(set(names)) != len(names):
            raise AuthConfigError(f"API key names must be unique, got {sorted(names)}")
        keys = [k for k, _ in self._entries]
        if len(set(keys)) != len(keys):
            raise AuthConfigError("two API keys are the same")

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def names(self) -> list[str]:
        return [p.name for _, p in self._entries]

    def authenticate(self, authorization: str | bytes | None) -> Principal | None:
        """The principal of an ``Authorization`` value (``Bearer <key>``); None when it
        is missing, not a bearer credential, or no key matches."""
        if isinstance(authorization, str):
            authorization = authorization.encode("latin-1", "replace")
        scheme, _, token = (authorization or b"").partition(b" ")
        if scheme.lower() != b"bearer" or not token:
            return None
        found = None
        for key, principal in self._entries:  # all of them: no early exit
            if hmac.compare_digest(token.strip(), key):
                found = principal
        return found

    @classmethod
    def load(
        cls,
        path: str | Path | None = None,
        key: str | None = None,
        environ: Mapping[str, str] | None = None,
    ) -> ApiKeys | None:
        """The keys of ``path`` (YAML), ``key`` (the config's single ``router.api_key``,
        named "default") and the environment (``BATON_API_KEYS``, ``BATON_API_KEY``),
        together; None when there are none (the front ends are open)."""
        environ = os.environ if environ is None else environ
        entries: list[tuple[str, Principal]] = []
        if path is not None:
            entries += _from_file(Path(path))
        if environ.get(ENV_KEYS):
            entries += _from_env(environ[ENV_KEYS])
        single = environ.get(ENV_KEY) or key
        if single:
            entries.append(
                (
                    _checked(single, ENV_KEY if environ.get(ENV_KEY) else "router.api_key"),
                    Principal("default", "default"),
                )
            )
        return cls(entries) if entries else None


def _checked(key: str, where: str) -> str:
    key = key.strip()
    if len(key) < MIN_KEY_LEN or any(c.isspace() for c in key):
        raise AuthConfigError(
            f"{where}: an API key must be at least {MIN_KEY_LEN} characters with no spaces"
        )
    return key


def _from_env(value: str) -> list[tuple[str, Principal]]:
    entries = []
    for i, item in enumerate(p for p in value.split(",") if p.strip()):
        name, sep, key = item.strip().partition("=")
        if not sep or not name:
            raise AuthConfigError(f"{ENV_KEYS}: entry {i} is not name=key")
        entries.append((_checked(key, f"{ENV_KEYS} ({name})"), Principal(name, name)))
    return entries


def _from_file(path: Path) -> list[tuple[str, Principal]]:
    """``keys: [{name, key, tenant?}, ...]``; the tenant defaults to the name."""
    try:
        data = yaml.safe_load(path.read_text())
    except OSError as exc:
        raise AuthConfigError(f"{path}: cannot read: {exc.strerror}") from None
    except yaml.YAMLError as exc:
        raise AuthConfigError(f"{path}: not valid YAML: {exc}") from None
    if not isinstance(data, dict) or not isinstance(data.get("keys"), list):
        raise AuthConfigError(f"{path}: expected a mapping with a list under 'keys'")
    entries = []
    for i, item in enumerate(data["keys"]):
        if not isinstance(item, dict) or set(item) - {"name", "key", "tenant"}:
            raise AuthConfigError(f"{path}: keys[{i}]: expected name, key and tenant (optional)")
        name, key = item.get("name"), item.get("key")
        tenant = item.get("tenant", name)
        if not all(isinstance(v, str) and v for v in (name, key, tenant)):
            raise AuthConfigError(f"{path}: keys[{i}]: name, key and tenant must be strings")
        entries.append((_checked(key, f"{path}: keys[{i}] ({name})"), Principal(name, tenant)))
    return entries
