"""The compiler work of test_isa_builds.py (the kernels built for older CPUs, the AMX paths checked as a Sapphire
Rapids compiler sees them): minutes of one core. tests/conftest.py starts it at `nice 19` as soon as collection
ends, so it soaks up the CPU the rest of the suite leaves idle (waiting on servers, sockets and sleeps: ~0.7 of two
cores over a `make test`); the tests then wait for their job and check its result. Run alone, each test does its own
work in the foreground. `python -m tests.model.isa_jobs JOB` is one job: `build:TARGET` or `amx-syntax`."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import sysconfig
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from tokenmill.model.cpu_kernels import _HEADERS, _SOURCES, _cpu_info

# target -> the instruction sets this CPU needs to run code built for it
TARGETS = {"haswell": {"avx2", "fma", "bmi2", "f16c"},
           "skylake-avx512": {"avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512cd"}}
FLAGS = set(_cpu_info()[1].split())
AMX_SYNTAX = "amx-syntax"
ROOT = Path(__file__).resolve().parents[2]

_jobs: dict[str, tuple[subprocess.Popen, Any]] = {}  # job -> its process, the file its output goes to


def build(target: str):
    """The kernels built (or already built) with -march=target, imported."""
    from torch.utils.cpp_extension import load

    sources = hashlib.sha1(b"".join(s.read_bytes() for s in (*_SOURCES, *_HEADERS))).hexdigest()[:8]
    flags = ["-O3", "-fopenmp", f"-march={target}", "-ffast-math", "-fno-finite-math-only"]
    return load(name=f"tokenmill_isa_check_{target.replace('-', '_')}_{sources}", sources=[str(s) for s in _SOURCES],
                extra_cflags=flags, extra_ldflags=["-fopenmp"])


def amx_syntax_check() -> dict:
    """{"skip": why} where the compiler does not know Sapphire Rapids, else {"failed": {source: compiler output}}:
    every source checked for errors (syntax, template instantiation; no code emitted) with AMX's macros defined."""
    from torch.utils.cpp_extension import include_paths

    includes = [f"-I{p}" for p in (*include_paths(), sysconfig.get_paths()["include"])]
    base = ["c++", "-std=c++17", "-fsyntax-only", "-march=sapphirerapids", "-fopenmp", "-DTORCH_EXTENSION_NAME=check"]
    probe = subprocess.run([*base, "-dM", "-E", "-x", "c++", "/dev/null"], capture_output=True, text=True, check=False)
    if probe.returncode != 0:
        return {"skip": f"this compiler does not know -march=sapphirerapids: {probe.stderr.strip()[:200]}"}
    if "__AMX_TILE__" not in probe.stdout or "__AMX_BF16__" not in probe.stdout:
        return {"failed": {"-march=sapphirerapids": "defines no __AMX_TILE__ / __AMX_BF16__"}}

    def check(source: Path) -> tuple[str, subprocess.CompletedProcess]:
        return source.name, subprocess.run([*base, *includes, str(source)], capture_output=True, text=True, check=False)

    with ThreadPoolExecutor(2) as pool:
        runs = list(pool.map(check, _SOURCES))
    return {"failed": {name: (run.stdout + run.stderr)[-2000:] for name, run in runs if run.returncode != 0}}


def background_jobs() -> list[str]:
    """The jobs worth starting early: the builds for the targets this CPU can run, the AMX check (with a compiler)."""
    if shutil.which("c++") is None:
        return []
    return [f"build:{t}" for t in sorted(TARGETS) if TARGETS[t] <= FLAGS] + [AMX_SYNTAX]


def start(jobs: list[str]) -> None:
    """Start each job in its own process (which lowers itself to nice 19), its output into a temporary file."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, (str(ROOT), os.environ.get("PYTHONPATH"))))}
    for job in jobs:
        if job not in _jobs:
            out = tempfile.TemporaryFile()
            proc = subprocess.Popen([sys.executable, "-m", "tests.model.isa_jobs", job], cwd=ROOT,
                                    env=env, stdout=out, stderr=subprocess.STDOUT,
                                    # its own process group (stop_all ends its compilers too), in the suite's
                                    # session: a new session would be a new autogroup, which the kernel
                                    # schedules as an equal of the suite's whatever its nice (a suite with the
                                    # jobs as their own session ran 983 s against 820 s)
                                    process_group=0)
            _jobs[job] = proc, out


def wait(job: str) -> tuple[int, str] | None:
    """The exit code and output of a job started in the background (None: it was not started)."""
    if job not in _jobs:
        return None
    proc, out = _jobs.pop(job)
    with out:
        proc.wait()
        out.seek(0)
        return proc.returncode, out.read().decode(errors="replace")


def stop_all() -> None:
    """End the jobs no test waited for (a run cut short by -x or a -k that kept the test but failed before it)."""
    for proc, out in _jobs.values():
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()
        out.close()
    _jobs.clear()


def amx_syntax_result() -> dict:
    """amx_syntax_check's answer, from the background job when one ran (its last line), else computed now."""
    done = wait(AMX_SYNTAX)
    if done is not None and done[0] == 0:
        return json.loads(done[1].strip().splitlines()[-1])
    return amx_syntax_check()  # not started, or crashed: again, in the foreground, where its error shows


def main(job: str) -> None:
    os.nice(19)  # the lowest priority, inherited by the compilers it starts
    if job == AMX_SYNTAX:
        print(json.dumps(amx_syntax_check()))
    elif job.startswith("build:"):
        build(job.removeprefix("build:"))
    else:
        raise SystemExit(f"unknown job {job!r}: build:TARGET or {AMX_SYNTAX}")


if __name__ == "__main__":
    main(sys.argv[1])
