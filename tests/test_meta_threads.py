"""Building a model on the meta device in one thread leaves every other thread's models real.

The flow process exports a checkpoint (trainers/format/export.py builds the model on meta first) while its gauntlet
loads another in a second thread; CI once saw the gauntlet's model come out on meta ("Cannot copy out of meta
tensor") and every retry after it fail the same way.
"""

from __future__ import annotations

import threading

import torch

from trainers.format.meta import parameters_on_meta


def _in_thread(inside: threading.Event, leave: threading.Event, built: list) -> threading.Thread:
    def run() -> None:
        with parameters_on_meta():
            built.append(torch.nn.Linear(4, 4))
            inside.set()
            leave.wait(30)

    thread = threading.Thread(target=run)
    thread.start()
    return thread


def test_a_model_built_while_another_thread_builds_on_meta_is_real():
    inside, leave, built = threading.Event(), threading.Event(), []
    thread = _in_thread(inside, leave, built)
    try:
        assert inside.wait(30)
        here = torch.nn.Linear(4, 4)
        assert here.weight.device.type == "cpu" and here.bias.device.type == "cpu"
        assert built[0].weight.device.type == "meta"  # the other thread's, on meta as asked
    finally:
        leave.set()
        thread.join(30)


def test_overlapping_calls_in_two_threads_leave_nothing_on_meta_after_them():
    first = (threading.Event(), threading.Event(), [])
    second = (threading.Event(), threading.Event(), [])
    a = _in_thread(*first)
    assert first[0].wait(30)
    b = _in_thread(*second)
    assert second[0].wait(30)
    first[1].set()  # the first to enter leaves first: a swap-and-restore patch would now restore the second's
    a.join(30)
    second[1].set()
    b.join(30)
    assert first[2][0].weight.is_meta and second[2][0].weight.is_meta
    after = torch.nn.Linear(4, 4)
    assert not after.weight.is_meta and not after.bias.is_meta
    with parameters_on_meta():  # and nesting in one thread still works
        with parameters_on_meta():
            inner = torch.nn.Linear(2, 2)
        outer = torch.nn.Linear(2, 2)
    assert inner.weight.is_meta and outer.weight.is_meta and not torch.nn.Linear(2, 2).weight.is_meta
