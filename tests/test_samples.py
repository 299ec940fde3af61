from areal_async.rollout.samples import SampleStream
from areal_async.types import Sample


def test_stream_is_deterministic_and_resumable():
    samples = [Sample(id=i, prompt=str(i), answer=str(i)) for i in range(7)]
    a = SampleStream(samples, seed=3)
    seq = [a.next().id for _ in range(20)]
    assert sorted(seq[:7]) == list(range(7)) and sorted(seq[7:14]) == list(range(7))  # every epoch a permutation
    assert seq[:7] != seq[7:14]  # a fresh order per epoch
    b = SampleStream(samples, seed=3, position=11)
    assert [b.next().id for _ in range(9)] == seq[11:]
