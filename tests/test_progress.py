"""Waiting for a program's outputs: the waiting threads are kept and reused, each piece of work
is watched from its start, a wait that never ends does not hold up the next one, and what
computing the outputs raised reaches the caller."""

import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mgkit import _contexts, _progress


class Gate:
    """An output whose ``block_until_ready`` (what ``jax.block_until_ready`` calls on a leaf that
    is not a jax array) waits until the gate opens, then raises ``error`` if one is set."""

    def __init__(self, error: BaseException | None = None):
        self.open, self.entered, self.error = threading.Event(), threading.Event(), error

    def block_until_ready(self):
        self.thread = threading.current_thread()
        self.entered.set()
        assert self.open.wait(30), "the gate was never opened"
        if self.error is not None:
            raise self.error
        return self


def _run() -> _progress.Run:
    return _progress.Run("test", [_contexts.resolve("dev0", "test")], [1], [1], None)


def _waiters() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "mgkit-wait"]


def test_waits_reuse_one_thread():
    run = _run()
    x = jnp.arange(4.0)
    works = [_progress.Work(x), _progress.Work(x + 1)]
    _progress.wait(works, run, False)
    np.testing.assert_array_equal(works[1].out, np.arange(1.0, 5.0))
    gates = [Gate() for _ in range(4)]
    for gate in gates:
        gate.open.set()
        work = _progress.Work(gate)
        _progress.wait([work], run, False)
        assert work.out is gate and work.ended >= work.began
    assert len({id(g.thread) for g in gates}) == 1  # one thread served every wait
    assert gates[0].thread.name == "mgkit-wait" and gates[0].thread.is_alive()
    run.close()


def test_each_piece_of_work_is_watched_from_its_start():
    run = _run()
    first, second = Gate(), Gate()
    works = [_progress.Work(first), _progress.Work(second)]
    first.open.set()
    assert works[0].done.wait(10) and not works[1].done.is_set()
    time.sleep(0.05)
    second.open.set()
    _progress.wait(works[::-1], run, False)  # waited for in any order, each has its own end
    assert works[1].ended - works[0].ended >= 0.05
    run.close()


def test_a_wait_still_blocked_does_not_hold_up_the_next():
    run = _run()
    stuck = Gate()
    blocked = _progress.Work(stuck)
    assert stuck.entered.wait(10)  # a waiting thread is blocked on the gate
    later = Gate()
    later.open.set()
    _progress.wait([_progress.Work(later)], run, False)  # served by another thread, at once
    assert later.thread is not stuck.thread
    stuck.open.set()
    _progress.wait([blocked], run, False)
    run.close()


def test_what_computing_raised_reaches_the_caller_and_the_thread_is_kept():
    run = _run()
    failing = Gate(RuntimeError("the device failed"))
    failing.open.set()
    with pytest.raises(RuntimeError, match="the device failed"):
        _progress.wait([_progress.Work(failing)], run, False)
    count = len(_waiters())
    work = _progress.Work(jnp.ones(3))
    _progress.wait([work], run, False)
    assert work.out.shape == (3,) and work.failure is None
    assert len(_waiters()) == count
    run.close()


def test_a_kept_waiter_whose_thread_is_gone_is_dropped():
    # A process forked after a wait inherits the kept waiter but not its thread: handing it a
    # wait would hang. Stand in for that with a waiter whose thread has ended.
    gone = _progress._Waiter.__new__(_progress._Waiter)
    gone._thread = threading.Thread(target=lambda: None)
    gone._thread.start()
    gone._thread.join()
    with _progress._Waiter._lock:
        _progress._Waiter._idle.append(gone)
    run = _run()
    gate = Gate()
    gate.open.set()
    _progress.wait([_progress.Work(gate)], run, False)
    assert gate.thread is not gone._thread and gate.thread.is_alive()
    assert gone not in _progress._Waiter._idle
    run.close()


def test_compile_runs_once_per_kind_of_arguments_and_the_call_reuses_it():
    traces = []

    @jax.jit
    def f(x):
        traces.append(x.shape)
        return x + 1

    _progress.compile(f, (jnp.ones(3),))
    _progress.compile(f, (jnp.ones(3),))  # known: returns at once
    assert traces == [(3,)]
    np.testing.assert_array_equal(f(jnp.ones(3)), np.full(3, 2.0))
    assert traces == [(3,)]  # the call found the compiled program: no second trace
    _progress.compile(f, (jnp.ones(4),))
    assert traces == [(3,), (4,)]
    for thread in [t for t in threading.enumerate() if t.name == "mgkit-compile"]:
        thread.join(10)


def test_a_compile_that_fails_is_left_to_the_call():
    @jax.jit
    def f(x):
        raise ValueError("bad program")

    _progress.compile(f, (jnp.ones(2),))  # the helper thread's error is not raised here
    with pytest.raises(ValueError, match="bad program"):
        f(jnp.ones(2))
