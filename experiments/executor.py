"""Where cells run, and the resumable runner that writes one result file per cell.

Executors are ``concurrent.futures.Executor`` objects:

* default: a local process pool (``spawn`` context, ``workers`` = cores), BLAS held to one thread
  per worker so that workers do not oversubscribe the cores;
* ``scheduler="tcp://host:port"`` (any Dask address, or a ``distributed.Client``): the cluster's
  standard executor, ``Client.get_executor()``; the same cells, the same numbers;
* ``scheduler="serial"``: in this process, one cell after another (notebooks, debugging).

Cells are pure functions of their parameters, so where they run does not change the numbers.
"""
import concurrent.futures as cf
import contextlib
import functools
import multiprocessing
import os
import sys
import time
import traceback
from pathlib import Path

from kvquant_experiments.common import environment, read_json, write_json

__all__ = ["CellBatch", "SerialExecutor", "UnitStore", "open_executor", "run_cells",
           "submit_cells", "tally_batch"]


class SerialExecutor(cf.Executor):
    """Runs each submitted call at once, in this process."""

    def submit(self, fn, /, *args, **kwargs):
        future = cf.Future()
        try:
            future.set_result(fn(*args, **kwargs))
        except Exception as exc:  # noqa: BLE001 - handed to the caller through the future
            future.set_exception(exc)     # (Ctrl-C is not: it stops the run at once)
        return future


class CarryingExecutor(cf.Executor):
    """An executor whose calls first register, in the worker, the codecs and spec kinds this
    process registered by hand (``kvquant.register_codec``, ``register_spec_kind``: a codec
    defined in a notebook cell), so that they run there by name as the installed ones do.
    They travel by value (cloudpickle) with each call; without registrations calls go as they
    are."""

    def __init__(self, inner):
        self._inner = inner
        self.kind, self.description = inner.kind, inner.description

    def submit(self, fn, /, *args, **kwargs):
        from kvquant.specs import process_registrations
        registrations = process_registrations()
        if not (registrations["codecs"] or registrations["kinds"]):
            return self._inner.submit(fn, *args, **kwargs)
        import cloudpickle
        return self._inner.submit(_with_registrations, cloudpickle.dumps(registrations), fn,
                                  *args, **kwargs)

    def shutdown(self, wait=True, *, cancel_futures=False):
        self._inner.shutdown(wait=wait, cancel_futures=cancel_futures)


def _with_registrations(payload, fn, *args, **kwargs):
    import pickle

    from kvquant.specs import restore_registrations
    restore_registrations(pickle.loads(payload))
    return fn(*args, **kwargs)


def _worker_init(threads):
    # One thread per worker: workers x threads = cores, no spinning thread teams fighting for them.
    try:
        from threadpoolctl import threadpool_limits
        threadpool_limits(threads)
    except ImportError:
        pass


@contextlib.contextmanager
def open_executor(scheduler=None, workers=None, threads_per_worker=1):
    """Yield an executor for cells; closes what it opened.

    Parameters
    ----------
    scheduler : None, "serial", str or distributed.Client
        None: local process pool. "serial": in this process. Any other string: the address of a
        Dask scheduler (``tcp://host:8786``). A ``distributed.Client``: use it (not closed here).
    workers : int, optional
        Local pool size; default the number of cores this process may use.
    threads_per_worker : int
        OpenMP and BLAS threads of each local worker (default 1: the pool is the parallelism).

    Yields
    ------
    concurrent.futures.Executor, with an attribute ``kind`` ("local", "serial" or "dask").
    """
    if scheduler == "serial":
        ex = SerialExecutor()
        ex.kind, ex.description = "serial", "serial (this process)"
        yield ex
        return
    if scheduler is None:
        if workers is None:
            try:
                workers = len(os.sched_getaffinity(0))
            except (AttributeError, OSError):
                workers = os.cpu_count() or 1
        if workers < 1:
            raise ValueError(f"workers must be >= 1, got {workers}")
        # spawn: a forked child of a process that already ran OpenMP regions may hang in libgomp.
        # Workers inherit the environment when they start (lazily, on submit): OpenMP reads
        # OMP_NUM_THREADS when it loads, before any initializer could set it.
        saved = os.environ.get("OMP_NUM_THREADS")
        os.environ["OMP_NUM_THREADS"] = str(int(threads_per_worker))
        ex = cf.ProcessPoolExecutor(max_workers=workers,
                                    mp_context=multiprocessing.get_context("spawn"),
                                    initializer=_worker_init,
                                    initargs=(int(threads_per_worker),))
        ex.kind = "local"
        ex.description = (f"local process pool ({workers} workers x {threads_per_worker} "
                          "thread(s))")
        try:
            yield CarryingExecutor(ex)
        except BaseException:
            # stopped (Ctrl-C, SIGTERM, an error): the workers stop too, mid-cell; without
            # this a pool kept computing cells nobody would read after its parent had gone
            for process in list((getattr(ex, "_processes", None) or {}).values()):
                process.terminate()
            raise
        finally:
            ex.shutdown(wait=True, cancel_futures=True)
            if saved is None:
                os.environ.pop("OMP_NUM_THREADS", None)
            else:
                os.environ["OMP_NUM_THREADS"] = saved
        return
    try:
        import distributed
    except ImportError:
        raise ImportError(
            "a Dask scheduler was given but distributed is not installed: "
            "pip install -e '.[dask]' in the kvquant source tree"
        ) from None
    if isinstance(scheduler, distributed.Client):
        client, owned = scheduler, False
    else:
        client, owned = distributed.Client(scheduler), True
    try:
        ex = client.get_executor()
        ex.kind = "dask"
        ex.description = f"Dask cluster at {client.scheduler.address}"
        yield CarryingExecutor(ex)
    finally:
        if owned:
            client.close()


@functools.lru_cache(maxsize=1)
def _worker_environment():
    return environment()


def _run_one(fn, cell):
    """Run one cell where the executor puts it; also report that process's environment.

    A cell that raises becomes ``{"available": False, "failed": True, "reason": "failed: ..."}``
    (never stored): one broken codec or model must not sink a whole sweep, and the report
    names it.
    """
    t0 = time.perf_counter()
    try:
        result = fn(cell)
    except Exception as exc:  # noqa: BLE001 - reported with the cell, not hidden
        result = {"available": False, "failed": True,
                  "reason": f"failed: {type(exc).__name__}: {exc}",
                  "traceback": traceback.format_exc()}
    return result, _worker_environment(), time.perf_counter() - t0


def _progress_bar(total, desc, enabled):
    if not enabled or total == 0:
        return None
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    return tqdm(total=total, desc=desc, unit="cell", file=sys.stderr, leave=False,
                dynamic_ncols=True)


class CellBatch:
    """Cells submitted to an executor; :meth:`wait` collects them and writes their files.

    Made by :func:`submit_cells`. ``reused`` counts the cells taken from stored files.
    """

    def __init__(self, fn, cells, out_dir, stem, executor, resume, progress, desc):
        self.out_dir = Path(out_dir)
        self.cells = list(cells)
        self.results = [None] * len(self.cells)
        self.reused = 0
        self.work_seconds = 0.0   # the computed cells' own seconds, where they ran
        self._progress, self._desc = progress, desc
        todo = []
        for i, cell in enumerate(self.cells):
            path = self.out_dir / f"{stem(cell)}.json"
            if resume and path.is_file():
                try:
                    stored = read_json(path)
                except (OSError, ValueError):
                    stored = None
                # a file that is valid JSON but not a cell of ours is recomputed, not trusted
                if (isinstance(stored, dict) and stored.get("params") == cell
                        and "result" in stored):
                    self.results[i] = stored["result"]
                    self.reused += 1
                    continue
            todo.append((i, cell, path))
        if self.reused and desc:
            print(f"{desc}: reused {self.reused} cells from {self.out_dir} (--fresh recomputes)",
                  file=sys.stderr, flush=True)
        executor = executor if executor is not None else SerialExecutor()
        self._futures = {executor.submit(_run_one, fn, cell): (i, cell, path)
                         for i, cell, path in todo}

    def _completed(self, bar):
        """The futures as they complete; the bar redrawn every second meanwhile, so that its
        elapsed time shows a long cell still running."""
        pending = set(self._futures)
        while pending:
            done, pending = cf.wait(pending, timeout=1.0, return_when=cf.FIRST_COMPLETED)
            if bar is not None and not done:
                bar.refresh()
            yield from done

    @property
    def computed(self):
        return len(self._futures)

    def wait(self):
        """Block until every cell is done; returns the results in the order of the cells."""
        bar = _progress_bar(len(self._futures), self._desc, self._progress)
        try:
            for future in self._completed(bar):
                i, cell, path = self._futures[future]
                result, env, seconds = future.result()
                self.work_seconds += seconds
                self.results[i] = result
                if result.get("available", True):
                    write_json(path, {"params": cell, "result": result, "environment": env,
                                      "seconds": seconds})
                if bar is not None:
                    bar.update(1)
        finally:
            if bar is not None:
                bar.close()
        return self.results


def submit_cells(fn, cells, out_dir, stem, executor=None, resume=True, progress=True, desc=None):
    """Submit the cells not already stored and return a :class:`CellBatch` (see
    :func:`run_cells` for the arguments); lets long batches overlap."""
    return CellBatch(fn, cells, out_dir, stem, executor, resume, progress, desc)


def tally_batch(tally, batch):
    """Add a waited :class:`CellBatch`'s ``reused``, ``computed`` and ``work_seconds`` (the
    computed cells' own seconds) to the dict ``tally`` (None: nothing)."""
    if tally is not None:
        for key in ("reused", "computed", "work_seconds"):
            tally[key] = tally.get(key, 0) + getattr(batch, key)
    return tally


def run_cells(fn, cells, out_dir, stem, executor=None, resume=True, progress=True, desc=None,
              tally=None):
    """Map ``fn`` over ``cells``, one result file per cell, resuming from files already written.

    Parameters
    ----------
    fn : callable
        A module-level (picklable) pure function ``fn(cell) -> dict``. A result with
        ``available == False`` (a codec not in this build, ...) is returned but not stored, so a
        later run computes it once the piece exists.
    cells : list of dict
        Parameters (JSON-compatible).
    out_dir : path
        Folder of the result files ``<stem(cell)>.json``, each holding ``params``, ``result``,
        ``environment`` (of the process that ran it) and ``seconds``.
    stem : callable
        ``stem(cell) -> str``, the file name from the parameters.
    executor : concurrent.futures.Executor, optional
        Default: run serially in this process.
    resume : bool
        Reuse a stored result whose parameters equal the cell's.
    progress : bool
        A tqdm bar on stderr (when tqdm is installed).
    tally : dict, optional
        Counts added to it (:func:`tally_batch`): what a caller times and announces.

    Returns
    -------
    list of dict
        The results, in the order of ``cells``.
    """
    batch = submit_cells(fn, cells, out_dir, stem, executor, resume, progress, desc)
    results = batch.wait()
    tally_batch(tally, batch)
    return results


class UnitStore:
    """The finished units of a long run (a chunk, a group of protocol prompts), one JSON file
    each in ``folder``, so that the same command after an interruption computes only the rest.

    A unit's file name is a hash of the run's ``identity`` (model, versions: everything that
    changes a number) and the unit's own parameters, so a unit of another run is never taken
    for this one's. Files are written atomically; numpy arrays are stored with their dtype and
    come back bit for bit (floats as their shortest repr).
    """

    def __init__(self, folder, identity=None):
        self.folder = Path(folder)
        self.identity = identity
        self.loaded = self.saved = self.unsaved = 0
        self._keys = set()

    def bind(self, identity):
        """Set the run's identity once the run knows it (e.g. after loading its model)."""
        self.identity = identity

    def discard(self):
        """Remove this run's unit files (and the folder when nothing else is in it): once the
        results are written they hold everything the units did."""
        for key in self._keys:
            try:
                os.unlink(self.folder / f"{key}.json")
            except OSError:
                pass
        try:
            self.folder.rmdir()
        except OSError:
            pass

    def key(self, kind, params):
        import hashlib
        import json
        if self.identity is None:
            raise RuntimeError("UnitStore.bind(identity) first")
        text = json.dumps(_to_json([self.identity, kind, params]), sort_keys=True)
        key = f"{kind}-{hashlib.sha256(text.encode()).hexdigest()[:24]}"
        self._keys.add(key)
        return key

    def get(self, key):
        path = self.folder / f"{key}.json"
        try:
            stored = read_json(path)
        except (OSError, ValueError):
            return None             # missing, or torn by a crash before the rename
        if not (isinstance(stored, dict) and "result" in stored):
            return None             # not a unit of ours: computed again
        self.loaded += 1
        return _from_json(stored["result"])

    def put(self, key, result):
        write_json(self.folder / f"{key}.json", {"result": _to_json(result)})
        self.saved += 1

    def done_callback(self, key):
        """A ``Future.add_done_callback`` that stores the unit's result when it succeeds.

        A unit that cannot be written (a full disk, a folder gone) is counted in ``unsaved``
        and said once on stderr: the run goes on with its result in memory (an exception in a
        callback would only be logged, as a traceback per unit, by concurrent.futures).
        """
        def store(future):
            if future.cancelled() or future.exception() is not None:
                return
            try:
                self.put(key, future.result())
            except OSError as exc:
                self.unsaved += 1
                if self.unsaved == 1:
                    print(f"kvquant: cannot save finished units in {self.folder} "
                          f"({exc.strerror or exc}); the run goes on, but an interrupted run "
                          "will compute them again", file=sys.stderr, flush=True)
        return store


def _to_json(obj):
    import numpy as np
    if isinstance(obj, np.ndarray):
        return {"__ndarray__": obj.dtype.str, "shape": list(obj.shape),
                "data": obj.ravel().tolist()}
    if isinstance(obj, np.generic):
        return {"__scalar__": obj.dtype.str, "value": obj.item()}
    if isinstance(obj, dict):
        return {k: _to_json(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_to_json(v) for v in obj]
    return obj


def _from_json(obj):
    import numpy as np
    if isinstance(obj, dict):
        if "__ndarray__" in obj:
            return np.array(obj["data"], dtype=obj["__ndarray__"]).reshape(obj["shape"])
        if "__scalar__" in obj:
            return np.dtype(obj["__scalar__"]).type(obj["value"])
        return {k: _from_json(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_from_json(v) for v in obj]
    return obj
