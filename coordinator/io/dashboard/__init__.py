"""The dashboard: one page (index.html, app.js, charts.js, style.css) served on the coordinator's port.

assets reads the files once, at import; the routes (coordinator/io/frontdoor/routes.py) serve
them. The page's data comes over its own websocket session (docs/OPERATIONS.md §Dashboard).
"""
