"""Which workers hand back requests still waiting for a place."""

from __future__ import annotations

from dynagraph.llm.router.rebalance import QueueView, releases


def q(w: int, active: int, waiting: int, slots: int = 8, request_s: float = 4.0) -> QueueView:
    return QueueView(w, active=active, waiting=waiting, slots=slots, request_s=request_s)


def test_waiting_requests_move_only_while_places_are_free() -> None:
    # 8 running + 6 waiting on 1; one place frees every 0.5 s there, so with a 1 s limit
    # the first 2 in line stay; 3 new idle workers have 24 places
    fleet = [q(1, 14, 6), q(2, 0, 0), q(3, 0, 0), q(4, 0, 0)]
    assert releases(fleet, min_wait_s=1.0) == {1: 4}
    # no free place: nothing moves
    assert releases([q(1, 14, 6), q(2, 8, 0)], min_wait_s=1.0) == {}
    # fewer free places than waiting requests: as many as there are places
    assert releases([q(1, 14, 6), q(2, 7, 0)], min_wait_s=1.0) == {1: 1}


def test_the_longest_queues_give_first_and_unknown_batches_are_left_alone() -> None:
    fleet = [q(1, 10, 2), q(2, 15, 7), q(3, 5, 0), q(4, 40, 30, slots=0)]
    # places: 3 free on worker 3; worker 2 (7 waiting) gives them, keeping 2
    assert releases(fleet, min_wait_s=1.0) == {2: 3}
    # a short queue that starts within the limit stays
    assert releases([q(1, 10, 2), q(2, 0, 0)], min_wait_s=1.0) == {}
    # long requests: even the first in line waits past the limit
    assert releases([q(1, 10, 2, request_s=40.0), q(2, 0, 0)], min_wait_s=1.0) == {1: 2}
