"""The admin routes: ``GET /admin/scale`` (each pool's workers) and ``POST /admin/scale``
(``{"prefill": N, "decode": M}``: live scaling, router/scaling.py; ``baton scale``).

They change the cluster, so they need the **admin key**, apart from the API keys: a file
(``router.admin_key_file``) or ``$BATON_ADMIN_KEY``, sent as ``Authorization: Bearer
<key>`` and compared in constant time. With no admin key configured they answer 403 to
everyone; a missing or wrong key gets 401. The HTTP app's guard checks the key before
the body is read (``admin_refusal``).
"""

from __future__ import annotations

import hmac
import os
from collections.abc import Mapping
from pathlib import Path

from fastapi import FastAPI
from pydantic import BaseModel, ConfigDict, StrictInt

from router.auth import MIN_KEY_LEN, AuthConfigError
from router.http.errors import OpenAIError
from router.router import Router
from router.scaling import ScaleError, ScaleResult

ENV_ADMIN_KEY = "BATON_ADMIN_KEY"
ADMIN_PREFIX = "/admin"
_KIND_STATUS = {"invalid": 400, "no_room": 409, "unavailable": 503, "failed": 500}


class AdminKey:
    """The one key the admin routes accept."""

    def __init__(self, key: str):
        self._key = key.encode()

    def accepts(self, authorization: bytes | None) -> bool:
        scheme, _, token = (authorization or b"").partition(b" ")
        is_bearer = scheme.lower() == b"bearer"
        return hmac.compare_digest(token.strip(), self._key) and is_bearer

    @classmethod
    def load(
        cls, path: str | Path | None = None, environ: Mapping[str, str] | None = None
    ) -> AdminKey | None:
        """``$BATON_ADMIN_KEY``, else the first line of ``path``; None when neither is set
        (the admin routes are off)."""
        environ = os.environ if environ is None else environ
        where, key = ENV_ADMIN_KEY, environ.get(ENV_ADMIN_KEY, "")
        if not key and path is not None:
            where = f"router.admin_key_file ({path})"
            try:
                key = Path(path).read_text().strip()
            except OSError as exc:
                raise AuthConfigError(f"{where}: cannot read: {exc.strerror}") from None
        if not key:
            return None
        key = key.strip()
        if len(key) < MIN_KEY_LEN or any(c.isspace() for c in key):
            raise AuthConfigError(
                f"{where}: the admin key must be at least {MIN_KEY_LEN} characters, no spaces"
            )
        return cls(key)


def admin_refusal(raw_headers, admin_key: AdminKey | None) -> OpenAIError | None:
    """The guard's answer to an admin request that must not reach its route; None: go on."""
    if admin_key is None:
        return OpenAIError(
            403,
            f"the admin routes are off: no admin key is configured (router.admin_key_file "
            f"or ${ENV_ADMIN_KEY})",
            type="permission_error",
            code="admin_disabled",
        )
    sent = [v for k, v in raw_headers if k == b"authorization"]
    if len(sent) != 1 or not admin_key.accepts(sent[0]):
        return OpenAIError(401, "missing or incorrect admin key", code="invalid_admin_key")
    return None


class ScaleRequest(BaseModel):
    """``POST /admin/scale``'s body: a pool left out keeps its size."""

    model_config = ConfigDict(extra="forbid")
    prefill: StrictInt | None = None
    decode: StrictInt | None = None


class PoolCounts(BaseModel):
    prefill: int
    decode: int


class ScaleAnswer(BaseModel):
    before: PoolCounts
    after: PoolCounts
    added: list[str]
    retired: list[str]
    migrated: int  # requests moved off a draining worker past its grace


def add_admin_routes(app: FastAPI, router: Router) -> None:
    @app.get(f"{ADMIN_PREFIX}/scale")
    async def get_scale() -> PoolCounts:
        prefill, decode = _scaling(router).current()
        return PoolCounts(prefill=prefill, decode=decode)

    @app.post(f"{ADMIN_PREFIX}/scale")
    async def post_scale(body: ScaleRequest) -> ScaleAnswer:
        scaling = _scaling(router)
        prefill, decode = scaling.current()
        if body.prefill is None and body.decode is None:
            raise OpenAIError(400, "give prefill, decode or both", param="prefill")
        target = (
            prefill if body.prefill is None else body.prefill,
            decode if body.decode is None else body.decode,
        )
        try:
            result = await scaling.scale_to(*target)
        except ScaleError as exc:
            status = _KIND_STATUS[exc.kind]
            kind = "invalid_request_error" if status < 500 else "service_unavailable_error"
            param = exc.message.split(":")[0] if exc.kind == "invalid" else None
            raise OpenAIError(status, exc.message, type=kind, param=param) from None
        return _answer(result)


def _scaling(router: Router):
    if router.scaling is None:
        raise OpenAIError(501, "this router cannot scale its pools (no provisioner)")
    return router.scaling


def _answer(result: ScaleResult) -> ScaleAnswer:
    (p0, d0), (p1, d1) = result.before, result.after
    return ScaleAnswer(
        before=PoolCounts(prefill=p0, decode=d0),
        after=PoolCounts(prefill=p1, decode=d1),
        added=list(result.added),
        retired=list(result.retired),
        migrated=result.num_migrated,
    )
