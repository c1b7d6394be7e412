"""The thread-count policy."""
import os

import pytest

from kvquant._threads import MIN_ELEMENTS_PER_THREAD, resolve_n_threads


def test_policy():
    assert resolve_n_threads(3) == 3
    assert resolve_n_threads(-1) == (os.cpu_count() or 1)
    assert resolve_n_threads(None) >= 1
    for bad in (0, -2):
        with pytest.raises(ValueError, match=str(bad)):
            resolve_n_threads(bad)
    with pytest.raises(TypeError):
        resolve_n_threads(2.0)


def test_small_work_stays_on_one_thread():
    assert resolve_n_threads(8, work=10) == 1
    assert resolve_n_threads(8, work=3 * MIN_ELEMENTS_PER_THREAD) == 3
    assert resolve_n_threads(2, work=10**9) == 2
