"""Build the Cython kernels of kvquant.

Every ``kvquant/_kernels/*.pyx`` becomes an extension module, built by the compiler setuptools
picks (``$CC`` when set: GCC and Clang both work, ``CC=clang``). OpenMP is used when that compiler
builds and links a program with ``-fopenmp`` (probed below; Clang needs LLVM's libomp, Debian's
``libomp-dev``); without it the kernels build and run single-threaded, and the build says so.
Flags: ``-O3 -g0``, never ``-ffast-math`` (NaN handling and rounding are part of the formats) and
``-ffp-contract=off`` (no silent FMA: the same rounding with or without -march=native).
Set ``KVQUANT_NATIVE=1`` to add ``-march=native`` (faster on the build machine, not portable).
Set ``KVQUANT_MARCH=<cpu>`` to add ``-march=<cpu>`` instead, e.g. ``KVQUANT_MARCH=x86-64-v2``
(SSE4.2, no AVX) to measure the portable paths of the consumers and the encoders as a CPU without
AVX2 or AVX-512 runs them (run it with ``KVQUANT_SIMD=portable``: the AVX2 and AVX-512 kernels
carry their own targets). The portable consumers' vector kernels need SSSE3 on x86: a build for
the baseline ISA (SSE2) keeps their scalar kernels.
"""
import functools
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

KERNEL_DIR = Path("kvquant") / "_kernels"


def _compiler_accepts_openmp(compiler_cmd):
    """Compile and link a tiny OpenMP program; True when it works."""
    src = "#include <omp.h>\nint main(void){return omp_get_max_threads() > 0 ? 0 : 1;}\n"
    tmp = tempfile.mkdtemp()
    try:
        c_file = os.path.join(tmp, "probe.c")
        with open(c_file, "w") as f:
            f.write(src)
        result = subprocess.run(
            compiler_cmd + ["-fopenmp", c_file, "-o", os.path.join(tmp, "probe")],
            capture_output=True,
        )
        return result.returncode == 0
    except OSError:
        return False
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _build_jobs():
    """Modules compiled at once: ``KVQUANT_BUILD_JOBS``, else the cores this process may use
    (each module is one C file compiled on its own; the bits do not depend on the order)."""
    env = os.environ.get("KVQUANT_BUILD_JOBS", "").strip()
    if env:
        return max(1, int(env))
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


# Built modules kept by the hash of everything that goes into them (below), so that installing
# one more extra later, or reinstalling, copies them instead of compiling again: pip builds an
# editable install in a fresh temporary folder each time.
MODULE_CACHE = Path(__file__).resolve().parent / "build" / "kvquant-modules"


@functools.lru_cache(maxsize=None)
def _compiler_identity(compiler):
    """``compiler --version`` (a tuple: the command), asked once per build."""
    try:
        out = subprocess.run([compiler[0], "--version"], capture_output=True, text=True)
        return out.stdout
    except OSError:
        return ""


class BuildExt(build_ext):
    def _module_key(self, ext):
        """A hash of the module's C source, the kernel headers it reads, the flags, the compiler
        and its version, Python's and numpy's versions: equal keys give the same module."""
        import hashlib
        import numpy
        h = hashlib.sha256()
        for path in list(ext.sources) + sorted(ext.depends or []):
            h.update(path.encode() + b"\0" + Path(path).read_bytes())
        compiler = list(getattr(self.compiler, "compiler_so", None) or ["cc"])
        for part in (compiler, ext.extra_compile_args, ext.extra_link_args, ext.define_macros,
                     ext.include_dirs, _compiler_identity(tuple(compiler)), sys.version,
                     numpy.__version__, self.get_ext_filename(ext.name)):
            h.update(repr(part).encode() + b"\0")
        return h.hexdigest()[:32]

    def build_extension(self, ext):
        target = Path(self.get_ext_fullpath(ext.name))
        cached = MODULE_CACHE / self._module_key(ext) / target.name
        if cached.is_file() and not self.force:
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(cached, target)
            print(f"kvquant: {ext.name} unchanged, reused from {cached.parent}", file=sys.stderr)
            return
        before = target.stat().st_mtime_ns if target.exists() else None
        super().build_extension(ext)
        if not target.exists() or target.stat().st_mtime_ns == before:
            return      # setuptools found it up to date: not built here with these flags
        cached.parent.mkdir(parents=True, exist_ok=True)
        tmp = cached.with_name(cached.name + f".{os.getpid()}.tmp")
        shutil.copy2(target, tmp)
        os.replace(tmp, cached)

    def finalize_options(self):
        super().finalize_options()
        if not self.parallel:       # setuptools compiles one module after another by default
            self.parallel = _build_jobs()

    def build_extensions(self):
        # the whole command (a wrapper such as `ccache clang` included) with its flags
        compiler = list(getattr(self.compiler, "compiler_so", None) or ["cc"])
        use_openmp = os.environ.get("KVQUANT_NO_OPENMP") != "1" and _compiler_accepts_openmp(
            compiler
        )
        # no contraction into FMA: results must not depend on -march (and match the numpy references).
        # -g0 drops the debug information Python's own flags ask for: the code generated is the
        # same (GCC and Clang never let -g change it), and consumers.c compiles in 549 s instead
        # of 743 s with half the memory (1.1 instead of 2.3 GB; two compiles side by side on
        # the 2-core machine)
        extra_compile = ["-O3", "-g0", "-fno-fast-math", "-ffp-contract=off"]
        march = os.environ.get("KVQUANT_MARCH", "").strip()
        if os.environ.get("KVQUANT_NATIVE") == "1":
            if march:
                sys.exit("kvquant: set KVQUANT_NATIVE=1 or KVQUANT_MARCH, not both")
            march = "native"
        if march:
            extra_compile.append(f"-march={march}")
        extra_link = []
        if use_openmp:
            extra_compile.append("-fopenmp")
            extra_link.append("-fopenmp")
        else:
            print("kvquant: the compiler has no OpenMP; kernels will run single-threaded",
                  file=sys.stderr)
        for ext in self.extensions:
            ext.extra_compile_args = extra_compile + list(ext.extra_compile_args or [])
            ext.extra_link_args = extra_link + list(ext.extra_link_args or [])
        super().build_extensions()


_HEADER_REF = re.compile(r'(?:cdef extern from|#include)\s+"([^"]+)"')
_CIMPORT_REF = re.compile(r"from kvquant\._kernels\.(\w+) cimport")


def _kernel_headers(source, seen=None):
    """The kernel headers a .pyx/.pxd/.h reads, directly or through cimported .pxd and #include.

    Each module rebuilds only when one of its own headers changes (a full rebuild of every
    module takes minutes).
    """
    seen = set() if seen is None else seen
    text = source.read_text()
    refs = [KERNEL_DIR / name for name in _HEADER_REF.findall(text)]
    refs += [KERNEL_DIR / f"{name}.pxd" for name in _CIMPORT_REF.findall(text)]
    for ref in refs:
        if ref.exists() and ref not in seen:
            seen.add(ref)
            _kernel_headers(ref, seen)
    return seen


def _extensions():
    from Cython.Build import cythonize

    exts = [
        Extension(
            f"kvquant._kernels.{pyx.stem}",
            [str(pyx)],
            include_dirs=[str(KERNEL_DIR)],
            # a header edit rebuilds the modules that read it (setuptools only compares the
            # sources otherwise)
            depends=[str(h) for h in sorted(_kernel_headers(pyx)) if h.suffix == ".h"],
            define_macros=[("NPY_NO_DEPRECATED_API", "NPY_1_7_API_VERSION")],
        )
        for pyx in sorted(KERNEL_DIR.glob("*.pyx"))
    ]
    return cythonize(
        exts,
        nthreads=_build_jobs(),
        language_level=3,
        compiler_directives={
            "boundscheck": False,
            "wraparound": False,
            "cdivision": True,
            "initializedcheck": False,
            "nonecheck": False,
        },
    )


setup(ext_modules=_extensions(), cmdclass={"build_ext": BuildExt})
