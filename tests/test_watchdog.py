"""mg.beat and mg.watchdog in one process (mg.launch's watchdog: tests/test_launch_watchdog.py)."""

import time
import warnings

import jax.numpy as jnp
import numpy as np
import optax
import pytest

import mgkit as mg


def test_watchdog_warns_once_per_stall_with_the_watched_stack():
    def stuck_here():
        time.sleep(0.9)

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with mg.watchdog(stall_after=0.3) as dog:
            for step in range(1, 4):
                mg.beat(step)
            stuck_here()
            mg.beat(4)  # progress again: a later stall is reported anew
            stuck_here()
    stalls = [w for w in caught if issubclass(w.category, mg.StallWarning)]
    assert len(dog.stalls) == len(stalls) == 2
    assert "no progress for" in dog.stalls[0] and "last step 3" in dog.stalls[0]
    assert "in stuck_here" in dog.stalls[0] and "time.sleep(0.9)" in dog.stalls[0]
    assert "last step 4" in dog.stalls[1]
    assert [e.info["step"] for e in mg.ledger().records("stall")] == [3, 4]


def test_watchdog_is_quiet_while_steps_go_on_and_ledger_events_count_as_progress():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with mg.watchdog(stall_after=0.4) as dog:
            for _ in range(8):
                mg.put(np.ones(3), "dev1")  # a ledger event: progress without a beat
                time.sleep(0.1)
    assert dog.stalls == [] and not [w for w in caught if issubclass(w.category, mg.StallWarning)]


def test_trainer_beats_every_step():
    seen = []
    from mgkit import _beat

    remove = _beat.add_watcher(lambda step, t: seen.append(step))
    try:
        tr = mg.Trainer(
            lambda p, b: jnp.mean((b["x"] * p) ** 2), optax.sgd(0.1), jnp.ones(()), contexts="dev0"
        )
        tr.fit({"x": np.ones((16, 1), np.float32)}, steps=5, batch_size=4)
    finally:
        remove()
    assert seen == [1, 2, 3, 4, 5]


def test_watchdog_interrupt_breaks_a_python_hang():
    t0 = time.perf_counter()
    with pytest.raises(KeyboardInterrupt), warnings.catch_warnings():
        warnings.simplefilter("ignore", mg.StallWarning)
        with mg.watchdog(stall_after=0.3, on_stall="interrupt"):
            while time.perf_counter() - t0 < 10:
                time.sleep(0.01)
    assert time.perf_counter() - t0 < 3


@pytest.mark.parametrize(
    ("step", "error", "words"),
    [
        (-1, ValueError, r"mg.beat: step=-1 is out of range; step must be a whole number at least 0"),
        (2.5, TypeError, r"mg.beat: step must be a whole number at least 0 .*got float 2.5; e.g. step=12"),
        (True, TypeError, r"got bool True"),
    ],
)
def test_a_step_is_a_whole_number_from_zero(step, error, words):
    with pytest.raises(error, match=words):
        mg.beat(step)
    mg.beat(0)
    mg.beat(np.int64(7))
