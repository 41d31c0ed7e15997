"""The OpenAI-compatible HTTP server: `tokenmill serve` (launch.py) runs create_app (app.py) over an AsyncEngine."""
