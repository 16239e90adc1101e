"""``mg.fits``: a training state's bytes per context planned from shapes, and bad input."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import mgkit as mg

PARAMS = {"w": np.zeros((4, 3), np.float32)}


def test_a_float64_batch_counts_as_the_float32_it_is_placed_as():
    x64 = np.zeros((64, 4), np.float64)  # 64-bit mode is off: placed as float32
    counted = [
        mg.fits(PARAMS, optax.sgd(0.1), contexts=8, batch=batch).rows()[0].batch
        for batch in (
            {"x": x64},
            {"x": x64.astype(np.float32)},
            {"x": jax.ShapeDtypeStruct((64, 4), np.float64)},
        )
    ]
    assert counted == [64 // 8 * 4 * 4] * 3


def test_float64_params_count_as_the_float32_the_trainer_holds():
    params = {"w": np.zeros((10, 3), np.float64), "b": np.zeros(3, np.float64)}
    planned = mg.fits(params, optax.adam(1e-3), contexts=8).rows()[0]
    tr = mg.Trainer(lambda p, b: jnp.mean(b @ p["w"] + p["b"]), optax.adam(1e-3), params, contexts=8)
    held = tr.memory().rows()[0]
    assert (planned.params, planned.opt_state) == (held.params, held.opt_state) == (33 * 4, 2 * 33 * 4 + 4)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (
            {"optimizer": "adam"},
            r"optimizer must be an optax GradientTransformation .*got str 'adam'; 'adam' names "
            r"an optimizer: make one with its learning rate, e\.g\. optax\.adam\(1e-3\)",
        ),
        (
            {"optimizer": optax.adam},
            r"optimizer must be .*got function .*; optax\.adam is the function that makes an optimizer: make "
            r"one with its learning rate, e\.g\. optax\.adam\(1e-3\)",
        ),
        ({"batch": "train.csv"}, r"batch is a str \('train\.csv'\); mgkit reads no files or text"),
        (
            {"batch": {"x": np.zeros((4, 2)), "y": np.zeros(3)}},
            r"batch's leaves have different row counts "
            r"\(\['x'\]: 4, \['y'\]: 3\)",
        ),
        ({"batch": {"x": np.array(["a", "b"])}}, r"batch leaf \['x'\] has dtype <U1 \(strings"),
    ],
)
def test_fits_checks_the_optimizer_and_batch_as_the_trainer_does(kwargs, message):
    args = {"optimizer": optax.sgd(0.1), **kwargs}
    with pytest.raises(TypeError if "row counts" not in message else ValueError, match="fits: " + message):
        mg.fits(PARAMS, args.pop("optimizer"), contexts=8, **args)
