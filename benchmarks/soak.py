"""Soak test of `tokenmill serve`: N concurrent clients for M minutes, with random disconnects; at the end the server
must be idle (nothing running or waiting, KV cache back to its idle usage), must never have answered 5xx, and its
memory (API process and engine process) must be flat.

    python benchmarks/soak.py                          # 16 clients, 2 minutes (`make soak`)
    python benchmarks/soak.py --minutes 0.3            # a quick check
    python benchmarks/soak.py --clients 32 --minutes 30 --server-args "--max-num-seqs 64"

The server is a real `tokenmill serve` on a free loopback port, started with tests/server/conftest.py's
start_server (float32, a 256 MiB KV cache, an API key). Each client loops until the time is up, sending (seeded,
so a run is repeatable in what it asks for) a mix of completions and chat, streaming and not, mostly short prompts
and a few long ones (~1000 tokens), n of 2 or 3 sometimes; about one request in six is abandoned on purpose: a
stream is closed after a random number of chunks, a non-streaming request is cancelled after a random delay.

Every few seconds it samples the resident memory (VmRSS from /proc) of the API process and of the engine process.
RSS is flat when, after a warm-up (the first 20% of the samples), the largest sample of the last third is within
max(10%, 50 MiB) of the largest sample of the first third.

Fails (exit 1) on: any 5xx or transport error or hang (no answer within --request-timeout), any 4xx other than a
429 (every request sent is valid), a stream that does not end with [DONE] or carries an error event, the server
not idle within 30 s after the last request, RSS growth beyond the bound, the server dead or unhealthy at the end,
or a non-zero exit on SIGTERM.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import shlex
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.server.conftest import ServerProcess, start_server

MIB = 1 << 20
WORDS = ["river", "mountain", "table", "window", "garden", "engine", "paper", "silver", "quiet", "orange",
         "market", "signal", "winter", "bridge", "candle", "forest", "letter", "museum", "harbor",
         "rocket", "planet", "violin", "thunder", "meadow", "castle", "pepper", "lantern"]
SHORT_PROMPTS = ["The capital of France is", "Once upon a time", "List three fruits:", "def fibonacci(n):",
                 "The weather today is", "Translate 'good morning' into Spanish:", "1, 2, 3, 4,",
                 "A haiku about the sea:"]
SHORT_CHATS = ["Name three colours.", "What is 2 + 2?", "Write one sentence about cats.", "Say hello.",
               "Give me a synonym for 'happy'.", "What colour is the sky?"]


# ---- the load ------------------------------------------------------------------------------------------------------


@dataclass
class Tally:
    sent: int = 0
    completed: int = 0
    disconnected: int = 0  # abandoned on purpose
    completion_tokens: int = 0
    statuses: Counter = field(default_factory=Counter)  # every answer's status (streams: 200)
    failures: list[str] = field(default_factory=list)  # what makes the run fail, first few kept in full

    def fail(self, what: str) -> None:
        self.failures.append(what)


def long_prompt(rng: random.Random) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(700, 1000))) + "\nSummarise the text above:"


def make_request(rng: random.Random) -> tuple[str, dict, str | None]:
    """(path, body, abandon) where abandon is None, 'chunks:K' or 'after:SECONDS'."""
    chat = rng.random() < 0.5
    stream = rng.random() < 0.5
    long = rng.random() < 0.08
    body: dict = {"max_tokens": rng.randint(8, 64), "temperature": rng.choice([0, 0.7, 1.0]),
                  "seed": rng.randrange(1 << 30)}
    if rng.random() < 0.15:
        body["n"] = rng.choice([2, 3])
    if chat:
        text = long_prompt(rng) if long else rng.choice(SHORT_CHATS)
        body["messages"] = [{"role": "user", "content": text}]
    else:
        body["prompt"] = long_prompt(rng) if long else rng.choice(SHORT_PROMPTS)
        if rng.random() < 0.3:
            body["ignore_eos"] = True
    if stream:
        body["stream"] = True
        body["stream_options"] = {"include_usage": True}
    abandon = None
    if rng.random() < 0.17:
        abandon = f"chunks:{rng.randint(1, 10)}" if stream else f"after:{rng.uniform(0.05, 2.0):.2f}"
    return ("/v1/chat/completions" if chat else "/v1/completions"), body, abandon


def describe(path: str, body: dict) -> str:
    shown = {k: (v if k not in ("prompt", "messages") or len(json.dumps(v)) < 80 else f"<{len(json.dumps(v))} chars>")
             for k, v in body.items()}
    return f"POST {path} {json.dumps(shown)}"


async def one_request(c: httpx.AsyncClient, path: str, body: dict, abandon: str | None, tally: Tally,
                      timeout: float) -> None:
    tally.sent += 1
    what = describe(path, body)
    try:
        if body.get("stream"):
            await asyncio.wait_for(stream_request(c, path, body, abandon, tally, what), timeout)
        elif abandon is not None:
            delay = float(abandon.split(":")[1])
            try:
                r = await asyncio.wait_for(c.post(path, json=body), delay)
            except TimeoutError:
                tally.disconnected += 1
                return
            check_answer(r.status_code, r.content, tally, what)
        else:
            r = await asyncio.wait_for(c.post(path, json=body), timeout)
            check_answer(r.status_code, r.content, tally, what)
    except TimeoutError:
        tally.statuses["hang"] += 1
        tally.fail(f"hang: no complete answer within {timeout:.0f} s: {what}")
    except httpx.HTTPError as e:
        tally.statuses["transport error"] += 1
        tally.fail(f"transport error {type(e).__name__}: {e}: {what}")
    except Exception as e:  # noqa: BLE001 - a body we cannot parse, ...: count it, keep the client going
        tally.statuses["bad answer"] += 1
        tally.fail(f"bad answer {type(e).__name__}: {e}: {what}")


def check_answer(status: int, content: bytes, tally: Tally, what: str) -> None:
    tally.statuses[status] += 1
    if status == 200:
        try:
            out = json.loads(content)
            tally.completion_tokens += out["usage"]["completion_tokens"]
            bad = [ch.get("finish_reason") for ch in out["choices"]
                   if ch.get("finish_reason") not in ("stop", "length")]
        except (ValueError, KeyError, TypeError) as e:
            tally.fail(f"200 with a bad body ({e!r}): {content[:200]!r}: {what}")
            return
        if bad:
            tally.fail(f"finish_reason {bad}: {what}")
        else:
            tally.completed += 1
    elif status != 429:  # 429 is load shedding; anything else is wrong for a valid request
        tally.fail(f"HTTP {status}: {content[:300]!r}: {what}")


async def stream_request(c: httpx.AsyncClient, path: str, body: dict, abandon: str | None, tally: Tally,
                         what: str) -> None:
    keep = int(abandon.split(":")[1]) if abandon else None
    async with c.stream("POST", path, json=body) as r:
        if r.status_code != 200:
            check_answer(r.status_code, await r.aread(), tally, what)
            return
        tally.statuses[200] += 1
        events: list = []
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            data = line[6:]
            events.append(data if data == "[DONE]" else json.loads(data))
            if keep is not None and len(events) >= keep:
                tally.disconnected += 1
                return  # leaving the block closes the connection mid-stream
    if not events or events[-1] != "[DONE]":
        tally.fail(f"stream without [DONE] (last: {events[-1:]!r}): {what}")
        return
    errors = [e for e in events[:-1] if isinstance(e, dict) and "error" in e]
    if errors:
        tally.statuses["error event"] += 1
        tally.fail(f"error event in a stream {errors[0]}: {what}")
        return
    usage = [e["usage"] for e in events[:-1] if isinstance(e, dict) and e.get("usage")]
    if usage:
        tally.completion_tokens += usage[-1]["completion_tokens"]
    tally.completed += 1


async def client_loop(i: int, url: str, headers: dict, seed: int, end: float, tally: Tally, timeout: float) -> None:
    rng = random.Random(seed * 1000 + i)
    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=timeout) as c:
        while time.monotonic() < end:
            path, body, abandon = make_request(rng)
            await one_request(c, path, body, abandon, tally, timeout)


# ---- the server's side: metrics, memory ----------------------------------------------------------------------------


def metrics(url: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            name = name.split("{", 1)[0]
            out[name] = out.get(name, 0.0) + float(value)
    return out


def rss(pid: int) -> int:
    """Resident memory of a process in bytes (0 if it is gone)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


async def sample_memory(pids: dict[str, int], every: float, done: asyncio.Event, samples: list) -> None:
    """Sample until the clients are done (the last requests may run past the end of the sending window)."""
    start = time.monotonic()
    while not done.is_set():
        samples.append((time.monotonic() - start, {name: rss(pid) for name, pid in pids.items()}))
        try:
            await asyncio.wait_for(done.wait(), every)
        except TimeoutError:
            pass


def flat(series: list[int], warmup_fraction: float = 0.2) -> tuple[bool, int, int, int]:
    """(flat?, first third's max, last third's max, allowed growth) over the samples after warm-up."""
    rest = series[int(len(series) * warmup_fraction):] or series
    third = max(1, len(rest) // 3)
    first, last = max(rest[:third]), max(rest[-third:])
    allowed = max(int(0.10 * first), 50 * MIB)
    return last <= first + allowed, first, last, allowed


def wait_idle(url: str, idle_kv: float, timeout: float) -> tuple[bool, dict]:
    deadline = time.monotonic() + timeout
    while True:
        m = metrics(url)
        state = {"running": m["tokenmill_num_requests_running"], "waiting": m["tokenmill_num_requests_waiting"],
                 "kv_usage": m["tokenmill_kv_cache_usage_ratio"]}
        if state["running"] == 0 and state["waiting"] == 0 and state["kv_usage"] <= idle_kv + 1e-9:
            return True, state
        if time.monotonic() > deadline:
            return False, state
        time.sleep(0.25)


# ---- main ----------------------------------------------------------------------------------------------------------


async def drive(server: ServerProcess, args, tally: Tally, samples: list) -> float:
    pids = {"api": server.proc.pid, "engine": server.engine_pid()}
    duration = args.minutes * 60
    every = min(args.sample_every, max(duration / 20, 0.2))
    t0 = time.monotonic()
    end = t0 + duration
    done = asyncio.Event()
    sampler = asyncio.ensure_future(sample_memory(pids, every, done, samples))

    async def progress():
        while not done.is_set():
            await asyncio.sleep(min(15.0, max(duration / 4, 1.0)))
            last = samples[-1][1] if samples else {}
            print(f"  {time.monotonic() - t0:6.0f} s: {tally.sent} sent, {tally.completed} completed, "
                  f"{tally.disconnected} disconnected, {len(tally.failures)} failures; RSS api "
                  f"{last.get('api', 0) / MIB:.0f} MiB, engine {last.get('engine', 0) / MIB:.0f} MiB", flush=True)

    reporter = asyncio.ensure_future(progress())
    await asyncio.gather(*(client_loop(i, server.url, server.headers, args.seed, end, tally, args.request_timeout)
                           for i in range(args.clients)))
    elapsed = time.monotonic() - t0
    done.set()
    reporter.cancel()
    await sampler
    return elapsed


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--clients", type=int, default=16, help="concurrent clients")
    p.add_argument("--minutes", type=float, default=2.0, help="how long the clients keep sending")
    p.add_argument("--seed", type=int, default=0, help="seed of what the clients send")
    p.add_argument("--request-timeout", type=float, default=180.0, help="longer without an answer is a hang")
    p.add_argument("--sample-every", type=float, default=3.0, help="seconds between RSS samples")
    p.add_argument("--server-args", default="", help="extra `tokenmill serve` flags, e.g. '--max-num-seqs 64'")
    args = p.parse_args()
    if args.clients < 1 or args.minutes <= 0:
        p.error("--clients must be >= 1 and --minutes > 0")

    print(f"starting tokenmill serve {args.server_args}".rstrip(), flush=True)
    server = start_server("--shutdown-timeout", "30", *shlex.split(args.server_args))
    failures: list[str] = []
    tally = Tally()
    samples: list = []
    try:
        idle_kv = metrics(server.url)["tokenmill_kv_cache_usage_ratio"]
        before = metrics(server.url)
        print(f"server {server.model} at {server.url} (API pid {server.proc.pid}, engine pid {server.engine_pid()});"
              f" {args.clients} clients for {args.minutes:g} min", flush=True)
        elapsed = asyncio.run(drive(server, args, tally, samples))

        idle, state = wait_idle(server.url, idle_kv, timeout=30)
        after = metrics(server.url)
        final = {"api": rss(server.proc.pid), "engine": rss(server.engine_pid())}
        samples.append((samples[-1][0] + 1 if samples else 0, final))
        health = httpx.get(server.url + "/health", timeout=10).status_code

        failures += tally.failures
        if not idle:
            failures.append(f"not idle 30 s after the last request: {state} (idle KV usage {idle_kv})")
        if health != 200:
            failures.append(f"/health answers {health} at the end")
        if any(isinstance(s, int) and s >= 500 for s in tally.statuses):
            failures.append("5xx answers: " + ", ".join(f"{s}: {n}" for s, n in tally.statuses.items()
                                                        if isinstance(s, int) and s >= 500))
        mem = {}
        for name in ("api", "engine"):
            ok, first, last, allowed = flat([s[1][name] for s in samples])
            mem[name] = (ok, first, last, allowed)
            if not ok:
                failures.append(f"{name} RSS grew: last third's max {last / MIB:.0f} MiB > first third's max "
                                f"{first / MIB:.0f} MiB + {allowed / MIB:.0f} MiB")
        print_summary(args, tally, elapsed, before, after, samples, mem, state)
    finally:
        code = server.stop(timeout=60)
    if code != 0:
        failures.append(f"the server exited {code} on SIGTERM; stderr tail:\n"
                        + "\n".join(server.stderr().splitlines()[-15:]))
    tracebacks = [line for line in server.stderr().splitlines() if line.startswith("Traceback")]
    if tracebacks:
        failures.append(f"{len(tracebacks)} tracebacks in the server log ({server.stderr_path})")
    if failures:
        print(f"\nFAILED: {len(failures)} problems; the first ones:")
        for f in failures[:20]:
            print("  - " + f)
        return 1
    print("\nOK: no 5xx, idle at the end, memory flat, clean shutdown")
    return 0


def print_summary(args, tally: Tally, elapsed: float, before: dict, after: dict, samples: list, mem: dict,
                  state: dict) -> None:
    generated = after["tokenmill_generation_tokens_total"] - before["tokenmill_generation_tokens_total"]
    aborts = after["tokenmill_request_aborts_total"] - before["tokenmill_request_aborts_total"]
    statuses = ", ".join(f"{s}: {n}" for s, n in sorted(tally.statuses.items(), key=lambda kv: str(kv[0])))
    rows = [
        ("clients x minutes", f"{args.clients} x {args.minutes:g} (ran {elapsed:.0f} s)"),
        ("requests sent", tally.sent),
        ("completed", tally.completed),
        ("disconnected on purpose", f"{tally.disconnected} (server counted {aborts:.0f} aborted samples)"),
        ("answers by status", statuses or "-"),
        ("failures", len(tally.failures)),
        ("completion tokens (clients)", f"{tally.completion_tokens} = {tally.completion_tokens / elapsed:.1f} tok/s"),
        ("tokens generated (server)", f"{generated:.0f} = {generated / elapsed:.1f} tok/s"),
        ("idle at the end", (f"running {state['running']:.0f}, waiting {state['waiting']:.0f}, "
                             f"KV usage {state['kv_usage']:.3f}")),
    ]
    for name in ("api", "engine"):
        series = [s[1][name] for s in samples]
        ok, first, last, allowed = mem[name]
        rows.append((f"RSS {name} start/end", (f"{series[0] / MIB:.0f} / {series[-1] / MIB:.0f} MiB (min "
                                               f"{min(series) / MIB:.0f}, max {max(series) / MIB:.0f}; "
                                               f"{len(series)} samples)")))
        rows.append((f"RSS {name} flat", (f"{'yes' if ok else 'NO'}: first third max {first / MIB:.0f} MiB, "
                                          f"last third max {last / MIB:.0f} MiB, allowed +{allowed / MIB:.0f} MiB")))
    width = max(len(k) for k, _ in rows)
    print("\nsoak summary")
    for k, v in rows:
        print(f"  {k:<{width}}  {v}")


if __name__ == "__main__":
    sys.exit(main())
