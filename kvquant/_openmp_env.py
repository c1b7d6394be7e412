"""OpenMP's wait policy, chosen before kvquant's kernels load.

After a parallel region libgomp's idle workers spin (GOMP's default: 300000 spins, then sleep),
and so do OpenBLAS's after a BLAS call. A model forward alternates the two (projections, then
attention, 30-90 times a step), so each pool's spinning takes the core the other needs: attention
on 2 threads was slower than on 1 inside a forward (experiments/bench_forward.py). With
``OMP_WAIT_POLICY=passive`` libgomp's workers sleep at once, and 2 attention threads give the
shortest steps. libgomp reads the variable once, when it is loaded, so it must be in the
environment before the first OpenMP-linked extension is imported: this module sets it then.

- A value the user set (any value) is kept.
- ``KVQUANT_KEEP_OMP_WAIT_POLICY=1`` leaves the variable alone (libgomp's default spinning).
- If libgomp is already in the process (torch, say, was imported first), setting the variable
  would change nothing; it is left alone and recorded as such.

Child processes inherit the variable, as they inherit any environment.
"""
import os

VARIABLE = "OMP_WAIT_POLICY"
KEEP_VARIABLE = "KVQUANT_KEEP_OMP_WAIT_POLICY"

# How the policy came to be, set once by apply(): "kvquant" (set here, in effect), "user" (the
# user's value), "kept" (KVQUANT_KEEP_OMP_WAIT_POLICY), "too-late" (a runtime was loaded first).
ORIGIN = None


# The kernels link libgomp by this soname; a copy already loaded under it (torch's wheel ships
# one) is the one they will share, with the policy it read when it loaded.
RUNTIME_SONAME = b"/libgomp.so.1"


def _openmp_runtime_loaded(maps_path="/proc/self/maps"):
    """True when libgomp is already mapped into this process (Linux; False where unknown)."""
    try:
        with open(maps_path, "rb") as f:
            maps = f.read()
    except OSError:
        return False
    return RUNTIME_SONAME in maps


def apply(environ=os.environ, runtime_loaded=None):
    """Set ``OMP_WAIT_POLICY=passive`` unless the user chose otherwise; return the origin."""
    global ORIGIN
    if ORIGIN is not None:
        return ORIGIN
    loaded = _openmp_runtime_loaded() if runtime_loaded is None else runtime_loaded
    if VARIABLE in environ:
        ORIGIN = "user"
    elif environ.get(KEEP_VARIABLE, "") not in ("", "0"):
        ORIGIN = "kept"
    elif loaded:
        ORIGIN = "too-late"
    else:
        environ[VARIABLE] = "passive"
        ORIGIN = "kvquant"
    return ORIGIN


def workers_sleep():
    """True when kvquant's OpenMP workers sleep as soon as they are idle (passive policy)."""
    if ORIGIN == "kvquant":
        return True
    if ORIGIN == "user":
        return os.environ.get(VARIABLE, "").strip().lower() == "passive"
    return False


def environ_as_started():
    """A copy of the environment without the variable kvquant set: for child processes that must
    choose the policy themselves (a benchmark comparing policies)."""
    env = dict(os.environ)
    if ORIGIN == "kvquant":
        env.pop(VARIABLE, None)
    return env


def describe():
    """One line for `kvquant info`."""
    value = os.environ.get(VARIABLE)
    how = {"kvquant": "set by kvquant before its kernels loaded",
           "user": "the user's value",
           "kept": f"left alone ({KEEP_VARIABLE})",
           "too-late": "left alone: libgomp was loaded before kvquant's kernels",
           None: "not yet decided"}[ORIGIN]
    return f"{VARIABLE}={value if value is not None else '(unset)'} ({how})"
