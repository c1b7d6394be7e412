"""kvquant chooses libgomp's wait policy before its kernels load; libgomp itself reports it.

libgomp prints its settings when ``OMP_DISPLAY_ENV=VERBOSE``: ``GOMP_SPINCOUNT`` is 0 under
``OMP_WAIT_POLICY=passive``, 300000 when the policy is unset and 3e10 under ``active`` (GCC's
libgomp manual, "GOMP_SPINCOUNT"). Each case runs in a fresh interpreter, since the policy is
read once per process.
"""
import json
import os
import re
import subprocess
import sys

import pytest

from kvquant import _openmp_env
from kvquant.models import gguf_decoder

PROBE = ("import json, kvquant; from kvquant import _openmp_env as e; "
         "from kvquant.models.gguf_decoder import cache_threads; "
         "print(json.dumps([e.ORIGIN, e.workers_sleep(), cache_threads()]))")


def _run(extra_env, prelude=""):
    env = {k: v for k, v in os.environ.items()
           if k not in (_openmp_env.VARIABLE, _openmp_env.KEEP_VARIABLE, "GOMP_SPINCOUNT")}
    env.update(extra_env, OMP_DISPLAY_ENV="VERBOSE")
    done = subprocess.run([sys.executable, "-c", prelude + PROBE], env=env, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    spin = re.findall(r"GOMP_SPINCOUNT = '(\d+)'", done.stderr)
    if not spin:
        pytest.skip("this libgomp does not report GOMP_SPINCOUNT under OMP_DISPLAY_ENV")
    return json.loads(done.stdout.strip().splitlines()[-1]), int(spin[-1])


def test_unset_policy_becomes_passive_before_the_kernels_load():
    (origin, sleeps, threads), spin = _run({})
    assert (origin, sleeps, threads, spin) == ("kvquant", True, None, 0)


def test_the_users_policy_is_kept():
    (origin, sleeps, threads), spin = _run({"OMP_WAIT_POLICY": "active"})
    assert (origin, sleeps, threads, spin) == ("user", False, 1, 30_000_000_000)
    (origin, sleeps, threads), spin = _run({"OMP_WAIT_POLICY": "PASSIVE"})
    assert (origin, sleeps, threads, spin) == ("user", True, None, 0)


def test_keep_variable_leaves_libgomps_default_spinning():
    (origin, sleeps, threads), spin = _run({"KVQUANT_KEEP_OMP_WAIT_POLICY": "1"})
    assert (origin, sleeps, threads, spin) == ("kept", False, 1, 300_000)


def test_a_runtime_loaded_first_is_detected_and_left_alone():
    # ctypes loads the same libgomp.so.1 the kernels link, as torch's wheel would.
    prelude = "import ctypes; ctypes.CDLL('libgomp.so.1'); "
    (origin, sleeps, threads), spin = _run({}, prelude)
    assert (origin, sleeps, threads, spin) == ("too-late", False, 1, 300_000)


def test_apply_decides_once_and_never_overrides(monkeypatch):
    monkeypatch.setattr(_openmp_env, "ORIGIN", None)
    env = {}
    assert _openmp_env.apply(env, runtime_loaded=True) == "too-late" and env == {}
    monkeypatch.setattr(_openmp_env, "ORIGIN", None)
    env = {"OMP_WAIT_POLICY": "active"}
    assert _openmp_env.apply(env, runtime_loaded=False) == "user"
    assert env == {"OMP_WAIT_POLICY": "active"}
    monkeypatch.setattr(_openmp_env, "ORIGIN", None)
    env = {}
    assert _openmp_env.apply(env, runtime_loaded=False) == "kvquant"
    assert env == {"OMP_WAIT_POLICY": "passive"}
    assert _openmp_env.apply({}, runtime_loaded=False) == "kvquant"   # decided once


def test_children_can_start_without_the_variable_kvquant_set(monkeypatch):
    monkeypatch.setattr(_openmp_env, "ORIGIN", "kvquant")
    monkeypatch.setenv("OMP_WAIT_POLICY", "passive")
    assert "OMP_WAIT_POLICY" not in _openmp_env.environ_as_started()
    monkeypatch.setattr(_openmp_env, "ORIGIN", "user")
    assert _openmp_env.environ_as_started()["OMP_WAIT_POLICY"] == "passive"


def test_an_explicit_cache_thread_count_wins(monkeypatch):
    monkeypatch.setattr(gguf_decoder, "CACHE_THREADS", 3)
    assert gguf_decoder.cache_threads() == 3
    monkeypatch.setattr(gguf_decoder, "CACHE_THREADS", None)
    monkeypatch.setattr(_openmp_env, "ORIGIN", "too-late")
    assert gguf_decoder.cache_threads() == 1
