"""The replicas behind the router: their health, their load, and a pool that can change at run time.

A replica is healthy while its `/health` answers 200; HEALTH_FAILURES failed checks in a row, or a request that
could not reach it, take it out, and one good check puts it back. Load is the router's own count of requests in
flight there, plus what a tokenmill replica's `/metrics` says is waiting (other servers: in-flight only). Each check
also reads the replica's `/v1/models`: a request naming a model the replica does not list is not sent there (a
replica whose list is unknown, not yet read or not served, takes any model).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import httpx

log = logging.getLogger("tokenmill.router")

HEALTH_FAILURES = 2


@dataclass
class Replica:
    url: str
    healthy: bool = True
    in_flight: int = 0
    waiting: int = 0  # the replica's own queue (tokenmill_num_requests_waiting), when it publishes one
    kv_usage: float = 0.0
    failures: int = 0  # failed health checks in a row
    requests: int = 0
    errors: int = 0
    checked_at: float = field(default=0.0)
    models: frozenset[str] | None = None  # the ids its /v1/models lists; None: not known
    # what is under way there: requests waiting for their response to begin (tasks) and responses being relayed;
    # taking the replica out cancels the first (they go to another replica) and closes the second (error event)
    pending: set = field(default_factory=set)
    relaying: set = field(default_factory=set)

    @property
    def load(self) -> int:
        return self.in_flight + self.waiting

    def serves(self, model: str | None) -> bool:
        """Whether a request naming `model` (None: none, the replica's default) may go here."""
        return model is None or self.models is None or model in self.models

    @contextmanager
    def busy(self) -> Iterator[None]:
        """A request's place in `in_flight`, from the choice of this replica to its last byte: the only place that
        counts, so a request that ends any way at all (done, failed, cancelled, its client gone) gives it back."""
        self.in_flight += 1
        self.requests += 1
        try:
            yield
        finally:
            self.in_flight -= 1


class ReplicaPool:
    def __init__(self, urls: list[str], api_key: str | None = None, health_interval_s: float = 2.0):
        self.backends: dict[str, Replica] = {}
        for url in urls:
            self.add(url)
        self.api_key = api_key
        self.health_interval_s = health_interval_s
        self._task: asyncio.Task | None = None
        self.on_removed = None  # callback(url): the prefix index forgets it

    @staticmethod
    def normalize(url: str) -> str:
        url = url.strip().rstrip("/")
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"a backend is an http(s) URL, got {url!r}")
        return url

    def add(self, url: str) -> Replica:
        url = self.normalize(url)
        return self.backends.setdefault(url, Replica(url))

    def remove(self, url: str) -> bool:
        url = self.normalize(url)
        gone = self.backends.pop(url, None) is not None
        if gone and self.on_removed is not None:
            self.on_removed(url)
        return gone

    def healthy(self, exclude: set[str] = frozenset(), model: str | None = None) -> list[Replica]:
        """The healthy replicas not in `exclude` that serve `model` (any, for None)."""
        return [b for b in self.backends.values() if b.healthy and b.url not in exclude and b.serves(model)]

    def mark_failed(self, backend: Replica, why: str) -> None:
        """A request could not reach it: out until a health check passes."""
        if backend.healthy:
            log.warning("backend %s taken out: %s", backend.url, why)
        backend.healthy = False
        backend.errors += 1

    @staticmethod
    async def take_out(backend: Replica) -> None:
        """A replica that stopped answering its health checks (hung, not just slow to refuse): what waits on it
        goes elsewhere, what streams from it ends."""
        backend.healthy = False
        for task in list(backend.pending):
            task.cancel()
        for upstream in list(backend.relaying):
            await upstream.aclose()

    # ---- health ---------------------------------------------------------------------------------------------
    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._health_loop())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
            self._task = None

    async def _health_loop(self) -> None:
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        async with httpx.AsyncClient(timeout=httpx.Timeout(5.0), headers=headers) as client:
            while True:
                await asyncio.gather(*(self.check(client, b) for b in list(self.backends.values())))
                await asyncio.sleep(self.health_interval_s)

    async def check(self, client: httpx.AsyncClient, backend: Replica) -> None:
        try:
            ok = (await client.get(backend.url + "/health")).status_code == 200
        except httpx.HTTPError:
            ok = False
        backend.checked_at = time.monotonic()
        if ok:
            if not backend.healthy:
                log.warning("backend %s is back", backend.url)
            backend.healthy, backend.failures = True, 0
            await self._scrape(client, backend)
            await self._read_models(client, backend)
        else:
            backend.failures += 1
            if backend.failures >= HEALTH_FAILURES and backend.healthy:
                log.warning("backend %s taken out: %d failed health checks", backend.url, backend.failures)
                await self.take_out(backend)

    @staticmethod
    async def _scrape(client: httpx.AsyncClient, backend: Replica) -> None:
        """A tokenmill replica's queue and KV usage from its /metrics (skipped quietly for other servers)."""
        try:
            resp = await client.get(backend.url + "/metrics")
        except httpx.HTTPError:
            return
        if resp.status_code != 200:
            return
        for line in resp.text.splitlines():
            if line.startswith(("tokenmill_num_requests_waiting{", "tokenmill_num_requests_waiting ")):
                backend.waiting = int(float(line.rsplit(" ", 1)[1]))
            elif line.startswith("tokenmill_kv_cache_usage_ratio"):
                backend.kv_usage = float(line.rsplit(" ", 1)[1])

    @staticmethod
    async def _read_models(client: httpx.AsyncClient, backend: Replica) -> None:
        """The model ids the replica's /v1/models lists (several for a tokenmill server with several --model);
        left as they were when it does not answer with a list."""
        try:
            resp = await client.get(backend.url + "/v1/models")
            data = resp.json()["data"] if resp.status_code == 200 else None
        except (httpx.HTTPError, ValueError, KeyError, TypeError):
            return
        if isinstance(data, list):
            backend.models = frozenset(card["id"] for card in data if isinstance(card, dict)
                                       and isinstance(card.get("id"), str))
