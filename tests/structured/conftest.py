"""Fixtures shared with tests/server: the openai and httpx clients of a module's real server."""

from tests.server.conftest import client, http  # noqa: F401 - fixtures, found by name
