"""An ASGI admin application for a running `HiCache`.

`AdminApp(cache, token=...)` is a plain ASGI callable (no web framework needed): mount it in
the serving process's ASGI server, or run it with uvicorn on its own. It attaches, replaces
and detaches the storage backend at run time and serves the Prometheus metrics; every request
needs the bearer token. See docs/operations-admin.md.
"""

from __future__ import annotations

from ._app import METRICS_PATH, STORAGE_PATH, AdminApp, AttachRequest, DetachRequest

__all__ = ["METRICS_PATH", "STORAGE_PATH", "AdminApp", "AttachRequest", "DetachRequest"]
