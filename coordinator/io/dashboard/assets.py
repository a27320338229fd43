"""The dashboard's files, read once, at import, from this folder.

Nothing is loaded from elsewhere, and a request can never name a file outside the fixed set
:data:`DASHBOARD_FILES`; the routes (coordinator/io/frontdoor/routes.py) answer from
:data:`STATIC`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Final

__all__ = ["DASHBOARD_FILES", "STATIC"]

_DASHBOARD_DIR: Final = Path(__file__).parent
_TYPES: Final = {
    ".html": "text/html; charset=utf-8",
    ".js": "text/javascript; charset=utf-8",
    ".css": "text/css; charset=utf-8",
}
#: URL path -> file in coordinator/io/dashboard/.
DASHBOARD_FILES: Final = {
    "/": "index.html",
    "/index.html": "index.html",
    "/dashboard/app.js": "app.js",
    "/dashboard/charts.js": "charts.js",
    "/dashboard/style.css": "style.css",
}


def _load_static() -> dict[str, tuple[bytes, str]]:
    files: dict[str, tuple[bytes, str]] = {}
    for path, name in DASHBOARD_FILES.items():
        file = _DASHBOARD_DIR / name
        if file.is_file():  # a wheel built without the dashboard still serves the rest
            files[path] = (file.read_bytes(), _TYPES[file.suffix])
    return files


#: URL path -> (body, content type), for the files present.
STATIC: Final = _load_static()
