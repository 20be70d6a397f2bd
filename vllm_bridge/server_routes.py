"""Server-side additions to `vllm serve` on a rollout node (loaded inside vLLM's API server process).

RequireKey (``--middleware vllm_bridge.server_routes.RequireKey``): vLLM 0.32 checks ``--api-key``
only on paths under /v1, /v2, /inference and /cohere (vllm/entrypoints/serve/middleware/
authenticate.py, GUARDED_PREFIX); the RL admin routes of VLLM_SERVER_DEV_MODE (/pause, /resume,
/collective_rpc, /update_weight_version, /reset_prefix_cache, ...) are open to anyone who can reach
the port. This middleware applies the same bearer-token check to every path except GET /health
(the liveness probe), using the server's own ``--api-key`` values (app.state.args.api_key).

No extra routes are needed: vLLM 0.32 has token ids in/out with per-token weight-version spans
(/inference/v1/generate), pause/resume, a version label and collective RPC into our worker
extension (vllm_bridge.worker_ext), which loads weight buckets from safetensors files.
"""

from __future__ import annotations

import hashlib
import secrets

OPEN_PATHS = ("/health",)


class RequireKey:
    """Pure ASGI middleware: 401 unless ``Authorization: Bearer <one of the server's keys>``."""

    def __init__(self, app) -> None:
        self.app = app
        self._hashes: list[bytes] | None = None

    def _keys(self, scope) -> list[bytes]:
        if self._hashes is None:
            app = scope.get("app")
            args = getattr(getattr(app, "state", None), "args", None)
            keys = [k for k in (getattr(args, "api_key", None) or []) if k]
            if not keys:
                import os

                keys = [k for k in [os.environ.get("VLLM_API_KEY", "")] if k]
            self._hashes = [hashlib.sha256(k.encode()).digest() for k in keys]
        return self._hashes

    def _allowed(self, scope) -> bool:
        hashes = self._keys(scope)
        if not hashes:  # no key configured: refuse everything rather than serve openly
            return False
        auth = b""
        for name, value in scope.get("headers") or []:
            if name == b"authorization":
                auth = value
                break
        scheme, _, token = auth.decode("latin-1").partition(" ")
        if scheme.lower() != "bearer":
            return False
        digest = hashlib.sha256(token.encode()).digest()
        ok = False
        for h in hashes:
            ok |= secrets.compare_digest(digest, h)
        return ok

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] in ("http", "websocket") and scope.get("method") != "OPTIONS":
            path = scope["path"].removeprefix(scope.get("root_path", ""))
            if path not in OPEN_PATHS and not self._allowed(scope):
                from starlette.responses import JSONResponse

                await JSONResponse({"error": "Unauthorized"}, status_code=401)(scope, receive, send)
                return
        await self.app(scope, receive, send)
