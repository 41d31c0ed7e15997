"""The kernels as other CPUs build them. model/cpu_kernels.py builds with -march=native, so the machine that runs the
tests only ever exercises its own instruction-set paths; here the same sources are built for older targets this
CPU can also run (an AVX2-only CPU, an AVX-512 one without BF16) and checked on this machine: they compile, their
float32 and bfloat16 paths agree with torch, the float32 matmul stays batch-invariant, and the bfloat16 matmul
refuses cleanly where its instructions are missing (`--dtype auto` then picks float32)."""

from __future__ import annotations

import hashlib
import shutil

import pytest
import torch
import torch.nn.functional as F

from tokenmill.model.backends.reference import paged_attention_sdpa
from tokenmill.model.cpu_kernels import _HEADERS, _SOURCES, _cpu_info

FLAGS = set(_cpu_info()[1].split())
# target -> the instruction sets this CPU needs to run code built for it
TARGETS = {"haswell": {"avx2", "fma", "bmi2", "f16c"},
           "skylake-avx512": {"avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512cd"}}

pytestmark = [pytest.mark.slow, pytest.mark.skipif(shutil.which("c++") is None, reason="no C++ compiler")]


def build(target: str):
    from torch.utils.cpp_extension import load

    sources = hashlib.sha1(b"".join(s.read_bytes() for s in (*_SOURCES, *_HEADERS))).hexdigest()[:8]
    flags = ["-O3", "-fopenmp", f"-march={target}", "-ffast-math", "-fno-finite-math-only"]
    return load(name=f"tokenmill_isa_check_{target.replace('-', '_')}_{sources}", sources=[str(s) for s in _SOURCES],
                extra_cflags=flags, extra_ldflags=["-fopenmp"])


@pytest.mark.parametrize("target", sorted(TARGETS))
def test_kernels_built_for_an_older_cpu_run_correctly_here(target):
    if not TARGETS[target] <= FLAGS:
        pytest.skip(f"this CPU cannot run code built for {target}")
    ops = build(target)
    assert ops.bf16_kernel() == ""  # neither target has AVX512-BF16 or AMX
    with pytest.raises(RuntimeError, match="no AVX512-BF16"):
        ops.bf16_linear(torch.zeros(1, 32, dtype=torch.bfloat16), ops.bf16_pack(torch.zeros(16, 32).bfloat16()), None)

    g = torch.Generator().manual_seed(0)
    w, x = torch.randn(960, 576, generator=g), torch.randn(70, 576, generator=g)
    packed = ops.f32_pack(w)
    torch.testing.assert_close(ops.f32_linear(x, packed, None), F.linear(x, w), atol=1e-4, rtol=1e-5)
    alone = torch.cat([ops.f32_linear(x[i:i + 1], packed, None) for i in range(70)])
    for m in (2, 3, 4, 5, 8, 9, 33, 70):
        assert torch.equal(ops.f32_linear(x[:m], packed, None), alone[:m]), f"batch of {m}"

    t, heads, kv_heads, dim, bs, length = 8, 9, 3, 64, 16, 75
    blocks = t * -(-length // bs)
    for dtype, tol in ((torch.float32, 1e-4), (torch.bfloat16, 2e-2)):
        k_cache, v_cache = (torch.randn(blocks + 1, bs, kv_heads, dim, generator=g).to(dtype) for _ in range(2))
        q = torch.randn(t, heads, dim, generator=g).to(dtype)
        tables, rows = torch.arange(blocks).view(t, -1), torch.arange(t)
        kv_lens = torch.arange(length - t + 1, length + 1)
        ours = ops.paged_attention(q, k_cache, v_cache, tables, rows, kv_lens, 0.125).float()
        ref = paged_attention_sdpa(q.float(), k_cache.float(), v_cache.float(), tables, rows, kv_lens, 0.125)
        torch.testing.assert_close(ours, ref, atol=tol, rtol=tol)


def test_the_amx_paths_compile():
    """No machine these tests run on need have AMX, so its code paths (the AMX tile matmuls and attention, compiled
    only where the target has AMX) would otherwise go unbuilt until a Sapphire Rapids machine builds them at start-up.
    Checked for errors as GCC compiles them for such a CPU (syntax and template instantiation, no code emitted)."""
    import subprocess
    import sysconfig

    from torch.utils.cpp_extension import include_paths

    includes = [f"-I{p}" for p in (*include_paths(), sysconfig.get_paths()["include"])]
    base = ["c++", "-std=c++17", "-fsyntax-only", "-march=sapphirerapids", "-fopenmp", "-DTORCH_EXTENSION_NAME=check"]
    probe = subprocess.run([*base, "-dM", "-E", "-x", "c++", "/dev/null"], capture_output=True, text=True, check=False)
    if probe.returncode != 0:
        pytest.skip(f"this compiler does not know -march=sapphirerapids: {probe.stderr.strip()[:200]}")
    assert "__AMX_TILE__" in probe.stdout and "__AMX_BF16__" in probe.stdout
    jobs = [subprocess.Popen([*base, *includes, str(s)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            for s in _SOURCES]
    errors = {s.name: job.communicate()[0] for s, job in zip(_SOURCES, jobs)}
    failed = {name: out for (name, out), job in zip(errors.items(), jobs) if job.returncode != 0}
    assert not failed, "\n".join(f"{name}:\n{out[-2000:]}" for name, out in failed.items())
