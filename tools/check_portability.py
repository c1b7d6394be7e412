"""The kernels built by other compilers and for other CPUs: the same bits, or a loud failure.

Two parts, each run when its tools are installed and reported as skipped otherwise:

1. The kernels' headers alone (tests/portable_kernels_check.c, no Python): built with GCC and
   Clang for x86-64 (baseline ISA, x86-64-v2, the build machine's CPU, plain C without vector
   extensions) and cross-compiled for aarch64 (GCC and Clang; NEON is aarch64's baseline, so the
   vector extensions become NEON), the aarch64 builds run under qemu-aarch64. Each build checks
   itself (vector kernels against the scalar ones, every lane width of the encoders against the
   portable one) and prints a hash of every output; every build must print the hashes of the
   plain-C build on this machine, case by case. A control build for aarch64 with FMA
   contraction allowed (the compiler's default there) shows that the comparison can fail.
   The extension modules' C (Cython's output) is also compiled for aarch64 (not run).
2. ``--clang-build``: the package built with ``CC=clang`` in a scratch copy of the working tree
   and a scratch virtualenv (this Python, its site packages visible), then the default test
   suite run there (``-x -q -m "not slow"``). Takes several minutes.

Writes only under ``--work`` (default: a temporary directory, removed afterwards unless
``--keep``). Exit status 0 when every part that ran passed.

    python tools/check_portability.py
    python tools/check_portability.py --clang-build --keep --work /tmp/kvq-portability

Debian / Ubuntu packages: clang, libomp-dev (OpenMP for Clang), gcc-aarch64-linux-gnu,
libc6-dev-arm64-cross, qemu-user.
"""
import argparse
import os
import platform
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
KERNELS = ROOT / "kvquant" / "_kernels"
CHECK_C = ROOT / "tests" / "portable_kernels_check.c"
AARCH64_SYSROOT = Path("/usr/aarch64-linux-gnu")
# the build's own rounding rules (setup.py): no fast math, no FMA contraction
EXACT = ["-ffp-contract=off", "-fno-fast-math"]


def _host_is_x86():
    return platform.machine().lower() in ("x86_64", "amd64")


def _builds():
    """(name, compiler command, flags, runs under qemu, is the control) of every build to try."""
    out = []
    host_cc = shutil.which("gcc") or shutil.which("cc")
    clang = shutil.which("clang")
    for cc_name, cc in (("gcc", host_cc), ("clang", clang)):
        if cc is None:
            continue
        out.append((f"{cc_name} host, plain C", [cc], ["-DKVQ_NO_VECTOR_EXT"], False, False))
        out.append((f"{cc_name} host, default ISA", [cc], [], False, False))
        if _host_is_x86():
            out.append((f"{cc_name} x86-64-v2", [cc], ["-march=x86-64-v2"], False, False))
        out.append((f"{cc_name} -march=native", [cc], ["-march=native"], False, False))
    if not _host_is_x86():
        return out
    cross = shutil.which("aarch64-linux-gnu-gcc")
    if cross:
        out.append(("aarch64 gcc (NEON)", [cross], [], True, False))
    if clang and (AARCH64_SYSROOT / "lib").is_dir():
        out.append(("aarch64 clang (NEON)", [clang, "--target=aarch64-linux-gnu"], [], True,
                    False))
    if cross:
        out.append(("aarch64 gcc, FMA contraction allowed (control)", [cross], [], True, True))
    return out


def _qemu():
    return shutil.which("qemu-aarch64") or shutil.which("qemu-aarch64-static")


def _build_and_run(name, cc, flags, emulated, control, work):
    """Returns (status line, digest lines or None)."""
    exe = work / ("check-" + "".join(c if c.isalnum() else "-" for c in name))
    exact = [] if control else EXACT
    made = subprocess.run([*cc, "-O2", *exact, *flags, "-I", str(KERNELS), str(CHECK_C), "-o",
                           str(exe), "-lm"], capture_output=True, text=True)
    if made.returncode != 0:
        tail = "\n    ".join(made.stderr.strip().splitlines()[-8:])
        return f"BUILD FAILED\n    {tail}", None
    cmd = [str(exe), "--digest"]
    if emulated:
        qemu = _qemu()
        if qemu is None:
            return "skipped (no qemu-aarch64: apt-get install qemu-user)", None
        cmd = [qemu, "-L", str(AARCH64_SYSROOT), *cmd]
    ran = subprocess.run(cmd, capture_output=True, text=True)
    lines = ran.stdout.splitlines()
    digests = [ln for ln in lines if ln.startswith("digest ")]
    problems = [ln for ln in lines if not ln.startswith(("digest ", "vectors=", "OK", "FAIL"))]
    vectors = lines[0] if lines else "?"
    if ran.returncode != 0 or not lines or lines[-1] != "OK":
        detail = "; ".join(problems[:3]) or ran.stderr.strip()[-300:]
        return f"SELF-CHECK FAILED ({vectors}): {detail}", digests
    return f"self-check OK ({vectors}, {len(digests)} hashes)", digests


def check_headers(work):
    """Part 1; returns True when every build that ran agrees with the reference."""
    ok = True
    reference = None
    builds = _builds()
    print("== kernels' headers alone: tests/portable_kernels_check.c ==")
    if not builds:
        print("  skipped: no C compiler")
        return True
    names = [b[0] for b in builds]
    if not any(n.startswith("clang") for n in names):
        print("  skipped: Clang builds (no clang: apt-get install clang)")
    if _host_is_x86() and not any(n.startswith("aarch64") for n in names):
        print("  skipped: aarch64 builds (no aarch64-linux-gnu-gcc: apt-get install "
              "gcc-aarch64-linux-gnu libc6-dev-arm64-cross)")
    if not _host_is_x86():
        print(f"  skipped: the aarch64 cross builds (this host is {platform.machine()})")
    for name, cc, flags, emulated, control in builds:
        status, digests = _build_and_run(name, cc, flags, emulated, control, work)
        if reference is None and digests is not None and status.startswith("self-check OK"):
            reference = (name, digests)
            print(f"  {name}: {status}; the reference")
            continue
        if digests is None or reference is None:
            print(f"  {name}: {status}")
            ok &= status.startswith("skipped") or control
            continue
        differ = [b for a, b in zip(reference[1], digests) if a != b]
        differ += digests[len(reference[1]):] + reference[1][len(digests):]
        cases = sorted({ln.split()[1].split("/")[0] for ln in differ})
        if control:
            verdict = (f"{len(differ)} of {len(reference[1])} hashes differ ({', '.join(cases)}):"
                       " the comparison detects a change of rounding" if differ else
                       "no hash differs: the comparison did NOT detect FMA contraction")
            print(f"  {name}: {verdict}")
            ok &= bool(differ)
            continue
        same = not differ and status.startswith("self-check OK")
        verdict = "same hashes" if not differ else (
            f"{len(differ)} hashes DIFFER from {reference[0]} ({', '.join(cases)})")
        print(f"  {name}: {status}; {verdict}")
        ok &= same
    return ok


# the directives of setup.py (they change the generated C, not what it needs from the target)
CYTHON_DIRECTIVES = "boundscheck=False,wraparound=False,cdivision=True,initializedcheck=False," \
                    "nonecheck=False"


def check_extensions_for_aarch64(work):
    """Part 1b: every extension module's C (Cython's output) compiled for aarch64 (an object
    file, not linked or run: this machine has no aarch64 Python), with this Python's and numpy's
    headers (both LP64 little-endian). Catches what only the modules use, such as a dispatch
    name without its non-x86 alias. Returns True when every module compiled (or it was
    skipped)."""
    print("== the extension modules' C for aarch64 (compiled, not run) ==")
    cross = shutil.which("aarch64-linux-gnu-gcc")
    if cross is None or not _host_is_x86():
        print("  skipped: " + ("not an x86-64 host" if cross else "no aarch64-linux-gnu-gcc"))
        return True
    try:
        import sysconfig

        import numpy
    except ImportError:
        print("  skipped: numpy is not installed")
        return True
    includes = ["-I", str(KERNELS), "-I", sysconfig.get_paths()["include"], "-I",
                numpy.get_include()]
    ok = True
    for pyx in sorted(KERNELS.glob("*.pyx")):
        c_file = work / f"{pyx.stem}.c"
        made = subprocess.run([sys.executable, "-m", "cython", "-3", "-X", CYTHON_DIRECTIVES,
                               "-I", str(ROOT), "-I", str(KERNELS), str(pyx), "-o", str(c_file)],
                              capture_output=True, text=True)
        if made.returncode != 0:
            print(f"  {pyx.name}: Cython failed\n    {made.stderr.strip()[-500:]}")
            ok = False
            continue
        built = subprocess.run([cross, "-c", "-O0", "-fPIC", "-fopenmp", *EXACT,
                                "-DNPY_NO_DEPRECATED_API=NPY_1_7_API_VERSION", *includes,
                                str(c_file), "-o", str(work / f"{pyx.stem}.o")],
                               capture_output=True, text=True)
        errors = [ln for ln in built.stderr.splitlines() if "error" in ln]
        print(f"  {pyx.name}: " + ("compiled" if built.returncode == 0 else
                                   "FAILED\n    " + "\n    ".join(errors[:6])))
        ok &= built.returncode == 0
    return ok


def _copy_tree(dst):
    """The working tree's tracked files (with their uncommitted edits) into dst."""
    files = subprocess.run(["git", "-C", str(ROOT), "ls-files", "-z"], capture_output=True,
                           check=True).stdout.decode().split("\0")
    for rel in filter(None, files):
        src = ROOT / rel
        if src.is_file():
            (dst / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dst / rel)


def clang_build(work, pytest_args):
    """Part 2; returns True when the build and the tests passed (or clang is missing)."""
    print("== the package built with CC=clang ==")
    clang = shutil.which("clang")
    if clang is None:
        print("  skipped: no clang (apt-get install clang libomp-dev)")
        return True
    src, venv = work / "src", work / "venv"
    src.mkdir()
    _copy_tree(src)
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", str(venv)],
                   check=True)
    py = venv / "bin" / "python"
    env = dict(os.environ, CC=clang)
    log = work / "clang-build.log"
    with open(log, "w") as f:
        built = subprocess.run([str(py), "-m", "pip", "install", "-v", "-e", ".", "--no-deps"],
                               cwd=src, env=env, stdout=f, stderr=subprocess.STDOUT)
    text = log.read_text()
    warnings = [ln.strip() for ln in text.splitlines()
                if "warning:" in ln and "-Wunused-function" not in ln]
    if built.returncode != 0:
        errors = [ln.strip() for ln in text.splitlines() if "error:" in ln][:8]
        print("  BUILD FAILED (log: %s)\n    %s" % (log, "\n    ".join(errors)))
        return False
    info = subprocess.run([str(venv / "bin" / "kvquant"), "info"], capture_output=True,
                          text=True, cwd=work).stdout
    openmp = next((ln for ln in info.splitlines() if ln.startswith("openmp")), "openmp: ?")
    print(f"  built ({openmp}; {len(warnings)} warnings besides unused functions; log: {log})")
    for w in warnings[:10]:
        print(f"    {w}")
    # CC stays set: the build tests probe the compiler that built the kernels
    tests = subprocess.run([str(py), "-m", "pytest", "-p", "no:cacheprovider", *pytest_args],
                           cwd=src, env=env, capture_output=True, text=True)
    summary = (tests.stdout.strip().splitlines() or ["(no output)"])[-1]
    print(f"  tests ({' '.join(pytest_args)}): {summary}")
    if tests.returncode != 0:
        print("\n".join("    " + ln for ln in tests.stdout.strip().splitlines()[-30:]))
    return tests.returncode == 0


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--clang-build", action="store_true",
                    help="also build the package with CC=clang and run its tests (minutes)")
    ap.add_argument("--pytest-args", default='-x -q -m "not slow"',
                    help='pytest arguments for --clang-build (default: -x -q -m "not slow")')
    ap.add_argument("--work", type=Path, help="scratch directory (default: a temporary one)")
    ap.add_argument("--keep", action="store_true", help="keep the scratch directory")
    args = ap.parse_args(argv)

    import shlex

    work = args.work or Path(tempfile.mkdtemp(prefix="kvq-portability-"))
    work.mkdir(parents=True, exist_ok=True)
    if any(work.iterdir()):
        sys.exit(f"check_portability: {work} is not empty; pass an empty or new --work")
    try:
        ok = check_headers(work)
        ok &= check_extensions_for_aarch64(work)
        if args.clang_build:
            ok &= clang_build(work, shlex.split(args.pytest_args))
        else:
            print("== the package built with CC=clang ==\n  skipped (pass --clang-build)")
    finally:
        if args.keep:
            print(f"scratch kept in {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)
    print("PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
