"""Request: identity semantics (the scheduler's `in` and `remove` must not compare every field)."""

from tokenmill.request import Request
from tokenmill.sampling_params import SamplingParams


def test_requests_compare_by_identity():
    params = SamplingParams(max_tokens=4)
    a = Request("same", [1, 2, 3], params, 4)
    b = Request("same", [1, 2, 3], params, 4)
    assert a != b and a == a
    queue = [a]
    assert b not in queue
    queue.remove(a)
    assert queue == []
