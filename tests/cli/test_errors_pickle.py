"""A trainer's worker process that meets a typed error hands it to its parent pickled (a
ProcessPoolExecutor does). Most of sigmaflight's errors pickled but did not unpickle (each
`__init__` takes other arguments than the one message it passes on), so the parent got
BrokenProcessPool and the pool was dead. Each comes back with its type, message and fields."""

from __future__ import annotations

import concurrent.futures
import multiprocessing
import pickle

import pytest

from sigmaflight import errors
from sigmaflight.checks import SettingError
from sigmaflight.rest import CAFileError
from sigmaflight.weights import WeightsPushError, WeightsPushNotFound

ERRORS = [
    errors.ApiError(422, "validation_error", "prompts: too many", [{"loc": ["body", "prompts"]}]),
    errors.NotFound(404, "not_found", "no rollout 'x'"),
    errors.Unauthorized(401, "unauthorized", "a token is needed"),
    errors.ServerUnreachable("http://127.0.0.1:9", "connection refused"),
    errors.RolloutFailed("rollout r failed: non_finite: step 3"),
    errors.RolloutCancelled("rollout r cancelled"),
    WeightsPushError("bad_weights", "shape", "w: shape (2,) not (3,)", tensor="w", push_id="p1"),
    WeightsPushNotFound("not_found", "unknown_model", "no model 'm'", push_id="p2", in_progress="p0"),
    SettingError("url", "not a URL", shown="http://h:abc"),
    CAFileError("/no/such.pem", "cannot read it"),
]


@pytest.mark.parametrize("error", ERRORS, ids=lambda e: type(e).__name__)
def test_each_error_comes_back_from_a_pickle_as_it_was(error):
    again = pickle.loads(pickle.dumps(error))
    assert type(again) is type(error) and str(again) == str(error) and again.args == error.args
    assert vars(again) == vars(error)


def _raise_not_found() -> None:
    raise errors.NotFound(404, "not_found", "no rollout 'gone'")


def test_a_process_pool_worker_raising_not_found_leaves_the_pool_working():
    context = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(1, mp_context=context) as pool:
        with pytest.raises(errors.NotFound, match="no rollout 'gone'") as info:
            pool.submit(_raise_not_found).result(timeout=120)
        assert info.value.status == 404 and info.value.type == "not_found"
        assert pool.submit(int, "7").result(timeout=60) == 7  # was: BrokenProcessPool
