"""The DualPath scheduler: which side reads which pages of a request."""

from __future__ import annotations

import pytest

from tierkv.dualpath.scheduler import Read, Side, choose_reads
from tierkv.errors import InputError

PB = 1 << 20   # 1 MiB pages
GB = 1e9


def sides(pq: float = 0, dq: float = 0, dholds: bool = True) -> tuple[Side, list[Side]]:
    return Side("p0", pq, GB), [Side("d0", dq, GB, 10 * GB, dholds), Side("d1", dq + 5e8, GB, 10 * GB, dholds)]


def test_pe_only_reads_everything_on_the_prefill_side() -> None:
    p, d = sides(pq=10 * GB)
    assert choose_reads("pe-only", 100, PB, p, d) == [Read("p0", 0, 100)]


def test_shorter_queue_takes_the_side_that_finishes_first() -> None:
    p, d = sides(pq=1 * GB)
    assert choose_reads("shorter-queue", 100, PB, p, d) == [Read("d0", 0, 100)]   # the less loaded decode side
    p, d = sides(dq=1 * GB)
    assert choose_reads("shorter-queue", 100, PB, p, d) == [Read("p0", 0, 100)]


def test_split_divides_the_pages_so_both_sides_finish_together() -> None:
    p, d = sides()
    reads = choose_reads("split", 1000, PB, p, d)
    assert [r.side for r in reads] == ["p0", "d0"] and reads[0].start == 0 and reads[-1].stop == 1000
    assert reads[0].stop == reads[1].start
    x = reads[0].stop
    t_p = p.finish_s(x * PB)
    t_d = d[0].finish_s((1000 - x) * PB)
    assert abs(t_p - t_d) <= PB / GB                     # within a page of each other
    assert x == 500                                      # forwarded as it is read: the faster link costs nothing
    # A link slower than the NIC, or busy, holds the decode part back: less of it goes there.
    slow = [Side("d0", 0, GB, 0.5 * GB)]
    assert 640 <= choose_reads("split", 1000, PB, p, slow)[0].stop <= 700
    busy = [Side("d0", 0, GB, 10 * GB, forward_queued_bytes=20 * GB)]   # 2 s of backlog: longer than it all here
    assert choose_reads("split", 1000, PB, p, busy) == [Read("p0", 0, 1000)]
    p, d = sides(pq=5 * GB)                               # a prefill queue longer than the whole request
    assert choose_reads("split", 1000, PB, p, d) == [Read("d0", 0, 1000)]


def test_a_side_whose_latency_outweighs_its_share_gets_none() -> None:
    p = Side("p0", 0, GB)
    # 100 pages of 1 MiB take 0.1 s here; asking the decode side costs 0.2 s before a byte moves.
    assert choose_reads("split", 100, PB, p, [Side("d0", 0, GB, latency_s=0.2)]) == [Read("p0", 0, 100)]
    assert choose_reads("shorter-queue", 100, PB, p, [Side("d0", 0, 10 * GB, latency_s=0.2)]) == [Read("p0", 0, 100)]
    # A small one still pays where the request is long: the split moves past the even point.
    reads = choose_reads("split", 1000, PB, p, [Side("d0", 0, GB, latency_s=0.1)])
    assert [r.side for r in reads] == ["p0", "d0"] and 540 <= reads[0].stop <= 560
    with pytest.raises(InputError, match="latency"):
        choose_reads("split", 10, PB, p, [Side("d0", 0, GB, latency_s=-1.0)])


def test_a_side_that_lacks_the_pages_is_never_chosen() -> None:
    p, d = sides(pq=100 * GB, dholds=False)
    for policy in ("pe-only", "shorter-queue", "split"):
        assert choose_reads(policy, 10, PB, p, d) == [Read("p0", 0, 10)]
    p = Side("p0", 0, GB, holds=False)
    _, d = sides()
    assert choose_reads("split", 10, PB, p, d) == [Read("d0", 0, 10)]
    with pytest.raises(InputError, match="no side holds"):
        choose_reads("split", 10, PB, p, [])


def test_bad_input() -> None:
    p, d = sides()
    assert choose_reads("split", 0, PB, p, d) == []
    with pytest.raises(InputError, match="unknown DualPath policy 'fastest'"):
        choose_reads("fastest", 10, PB, p, d)
    with pytest.raises(InputError, match="rate of 0"):
        choose_reads("split", 10, PB, Side("p0", 0, 0.0), d)
