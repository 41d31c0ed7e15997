"""What one engine step's message costs to cross the process boundary: msgspec MessagePack (what the engine sends,
engine/messages.py) against pickle of the same objects, encode + decode, median of several rounds; and what one
request's AddRequest (pickled: it carries SamplingParams) costs, once per request.

    python benchmarks/boundary_codec.py [--rounds 7] [--iterations 20000]
"""

from __future__ import annotations

import argparse
import pickle
import statistics
import time

from tokenmill.engine.kv_cache import PrefixCacheStats
from tokenmill.engine.messages import AddRequest, EngineCoreOutput, EngineOutputs, decode_output, encode_output
from tokenmill.engine.step_cost import StepCost
from tokenmill.engine.step_types import SchedulerStats
from tokenmill.sampling_params import SamplingParams


def step_message(streams: int, logprobs: bool) -> EngineOutputs:
    """A decode step's news as the engine sends it: one token per stream, the scheduler's stats."""
    outs = [EngineCoreOutput(f"cmpl-{i:032x}#0", [1234 + i], [{1234 + i: -0.1, 5: -2.0, 6: -3.5}] if logprobs
                             else None) for i in range(streams)]
    stats = SchedulerStats(streams, 0, 0, 0.31, 0, 51_200, PrefixCacheStats(900, 400, 0, 37), None, {"blocks": 0},
                           StepCost(0.012, 1.1e-4, 3e-9, 1.2), 9_000, {0: 0}, 0.4)
    return EngineOutputs(outs, {}, {}, stats)


def per_call_us(fn, iterations: int, rounds: int) -> float:
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(iterations):
            fn()
        times.append((time.perf_counter() - start) / iterations * 1e6)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--iterations", type=int, default=20_000)
    args = ap.parse_args()
    print(f"{'message':<28} {'pickle us':>10} {'msgspec us':>11} {'ratio':>6} {'pickle B':>9} {'msgspec B':>10}")
    for streams, logprobs in ((1, False), (16, False), (64, False), (16, True)):
        msg = step_message(streams, logprobs)
        assert decode_output(encode_output(msg)) == msg and pickle.loads(pickle.dumps(msg, protocol=5)) == msg
        p = per_call_us(lambda: pickle.loads(pickle.dumps(msg, protocol=5)), args.iterations, args.rounds)
        m = per_call_us(lambda: decode_output(encode_output(msg)), args.iterations, args.rounds)
        name = f"{streams} streams" + (", 3 logprobs" if logprobs else "")
        print(f"{name:<28} {p:>10.1f} {m:>11.1f} {p / m:>5.1f}x {len(pickle.dumps(msg, protocol=5)):>9} "
              f"{len(encode_output(msg)):>10}")
    add = [AddRequest("cmpl-0123456789abcdef0123456789abcdef#0", list(range(1000, 1600)),
                      SamplingParams(temperature=0.7, top_p=0.9, max_tokens=256, stop=["\n\n"]), 256,
                      frozenset({2}), time.monotonic())]
    p = per_call_us(lambda: pickle.loads(pickle.dumps(add, protocol=5)), args.iterations // 4, args.rounds)
    print(f"{'AddRequest, 600-token prompt':<28} {p:>10.1f} {'-':>11} {'-':>6} {len(pickle.dumps(add, protocol=5)):>9}")


if __name__ == "__main__":
    main()
