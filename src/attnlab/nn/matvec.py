"""One-row matrix-vector products at the memory's speed: the decode step's matmuls on the CPU.

Decoding one token multiplies one row of activations (or a few, one per running request) by every
weight matrix once, so its time is the time to read the weights. torch's CPU path for a (1, K) ×
(N, K)ᵀ product is MKL's sgemm, which reads at ~15 GB/s on 2 cores of an AMD EPYC that sums a
tensor at ~45 GB/s (benchmarks/cpu_decode.py `--micro` measures both), and its int8/int4 weight
kernels (`aten._weight_int8pack_mm`, `_weight_int4pack_mm_for_cpu`) are fast only for bf16
activations: with fp32 ones they take a reference loop 10-100× slower than an fp32 matmul.

So the few-row products are our own loops (src/attnlab/nn/csrc/matvec.cpp), built once per machine
by `torch.utils.cpp_extension` (g++ and ninja; about 2 min on 2 cores of an AMD EPYC, 254 s and
288 s measured with those cores shared (load ~9); said on stderr when it starts and ends, then
loaded from ~/.cache/torch_extensions, or $TORCH_EXTENSIONS_DIR, in a folder named by the ISA and a
hash of the sources, flags, torch and python: one build per content, shared by every checkout that
has it) for the CPU that runs them: `-march=native`, or AVX2+FMA when
`ATEN_CPU_CAPABILITY=avx2` caps torch to AVX2, or the compiler's baseline for `default`. Each weight
row is read once and its products kept in independent fp32 lanes (AVX2 / AVX-512 intrinsics where
the build has them, plain loops the compiler vectorises elsewhere); rows are split over torch's
intra-op threads. A call costs a few microseconds, against ~20 µs for a `torch.compile`d kernel's
guards (measured while choosing: Inductor's kernels read as fast but a decode step makes ~120
calls). Without a compiler, or with `ATTNLAB_KERNELS=0`, `available()` is False (said once) and
callers take torch's own paths.

The build runs under build_lock.py: an flock the kernel drops when its holder dies (SIGKILL too),
never torch's `lock` file, which a killed builder left behind for every later process to wait on
forever; a marker written once the built module has loaded, so a build cut short is rebuilt, never
loaded; the compilers in a session of their own, killed with the process that started them (SIGTERM,
SIGHUP, SIGKILL, Ctrl-C); and a bounded wait for another process's build
(`ATTNLAB_KERNEL_BUILD_WAIT`, 600 s by default), past which torch's paths are taken (said once).

The kernels, each the same function as its reference in tests/nn/test_matvec.py (float64):

- `mv`: x (M, K) fp32, w (N, K) fp32 -> (M, N).
- `mv_int8`: q (N, K) int8, s (N,) fp32: Σ_k q_nk x_k · s_n (the row's scale factored out of its
  sum: the dequantized weight s_n·q_nk times x, up to fp32 summation order).
- `mv_q4`: 4-bit weights in blocks of 32 along K (GGUF's Q4_0/Q4_1 block layout): p (N, G, 16)
  uint8 holds element j of a block in its low nibble and element j + 16 in its high one; w = d·q
  + m per block with d, m (N, G) fp32. y = Σ_g d_g (Σ_j q_gj x_gj) + Σ_g m_g (Σ_j x_gj).
- `mv_q8`: GGUF's Q8_0: q (N, G, 32) int8, d (N, G) fp32, w = d·q; or d (N, 2G), one per 16
  elements (Q6_K's scales: element j of block b of row n takes d[n, 2b + j // 16]).
- `mv_q4_x8`, `mv_q8_x8`: the same blocks times int8 activation blocks (`quantize_x8`: x ≈ dx·xq
  per block of 32), integer products per block (`quant_blocks.int8_activations` switches a
  model's block maps to them; csrc/rows.h).
- `mm_q4`, `mm_q8`: the same blocks times more rows (a batched decode step, a prefill: the
  products are compute-bound there): W dequantized a tile of rows at a time into a buffer that
  stays in cache, each tile times x by torch's GEMM on one thread, the tiles split over the
  threads, so the fp32 matrix never exists whole (the block maps use them above MAX_ROWS rows).

The same row kernels (csrc/rows.h) serve `Step` (csrc/step.cpp), a whole decode step in one call
(src/attnlab/decode/native_step.py), and `paged_decode` (csrc/paged.cpp), the engine's decode
attention over its paged KV pool read in place (src/attnlab/nn/attention/kernels/paged.py).

By default the activations stay fp32 (no rounding of x, unlike llama.cpp's int8 activation
blocks), so a packed model computes its dequantized model's values up to fp32 summation order.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import json
import os
import sys
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F

MAX_ROWS = 8  # up to this many rows the kernels beat torch's matmul (weights read once for all)
_SOURCE = Path(__file__).with_name("csrc") / "matvec.cpp"
_state: dict[str, str | None] = {"broken": None}  # why building failed, once it has


def isa_flags() -> tuple[str, list[str]]:
    """The build's name and compiler flags for this CPU, following torch's own cap."""
    cap = os.environ.get("ATEN_CPU_CAPABILITY", "").lower()
    if cap == "default":
        return "default", []
    if cap == "avx2":
        return "avx2", ["-mavx2", "-mfma", "-mf16c"]
    return "native", ["-march=native"]


_FLAGS = ["-O3", "-fopenmp", "-ffp-contract=off"]  # -ffp-contract=off: d·q + m as torch rounds


def _build_name() -> str:
    """The extension's name, which is also its build folder's (under torch's extensions root):
    the ISA, then a hash of what the build is made of (`_content_key`). Two checkouts of the same
    sources (a second clone, CI's, a second venv) share one build; checkouts whose sources differ
    get a folder each, so switching between them loads each one's build instead of rebuilding the
    other's, and neither waits on the other's compiler."""
    name, _ = isa_flags()
    if name == "native":  # a -march=native build is this CPU's: another one builds its own
        name += "_" + _cpu_key()
    return f"attnlab_matvec_{name}_{_content_key(name)[:12]}"


@functools.cache
def _content_key(isa: str) -> str:
    """What the build is made of, not where: the sources' names and bytes (the headers too: ninja
    rebuilds for them), the ISA and flags, torch and python."""
    flags = [*_FLAGS, *isa_flags()[1]]
    key = hashlib.sha1(json.dumps([isa, flags, torch.__version__, sys.version]).encode())
    for f in sorted(_SOURCE.parent.glob("*.[ch]*")):
        key.update(f.name.encode())
        key.update(f.read_bytes())
    return key.hexdigest()


@functools.cache
def _ext():
    from torch.utils import cpp_extension

    name, (_, flags) = _build_name(), isa_flags()
    spec = {
        "name": name,
        "sources": [str(_SOURCE), *(str(_SOURCE.with_name(f)) for f in ("step.cpp", "paged.cpp"))],
        "extra_cflags": [*_FLAGS, *flags],
        "verbose": False,
    }
    if os.name != "posix":  # no flock: torch's own baton
        return cpp_extension.load(**spec)
    from attnlab.nn import build_lock  # posix only (fcntl)

    build_dir = Path(cpp_extension._get_build_directory(name, verbose=False))
    spec["build_directory"] = str(build_dir)
    product = build_dir / f"{name}{cpp_extension.LIB_EXT}"
    return build_lock.load_once(
        build_dir,
        _content_key(name),
        [sys.executable, "-c", _BUILD, json.dumps(spec)],
        product,
        functools.partial(_import, name, product),
        what="attnlab's CPU kernels",
        start="attnlab: building attnlab's CPU kernels once (about 2 min on 2 cores; needs g++ and "
        f"ninja); later runs load them from {build_dir}",
    )


_BUILD = (
    "import json, sys; from torch.utils.cpp_extension import load; load(**json.loads(sys.argv[1]))"
)


def _import(name: str, path: Path):
    """The built module at path (what torch's load does once it has built)."""
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"{path} is not an extension module")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _cpu_key() -> str:
    """A short hash of this CPU's flags (/proc/cpuinfo), so a build cached in a home folder shared
    between machines is never loaded on a CPU that lacks its instructions."""
    try:
        text = Path("/proc/cpuinfo").read_text()
        flags = next((ln for ln in text.splitlines() if ln.startswith("flags")), "")
    except OSError:
        flags = ""
    return hashlib.sha1(" ".join(sorted(flags.split())).encode()).hexdigest()[:10]


def available() -> bool:
    """Whether the kernels may be used: not switched off (`ATTNLAB_KERNELS=0`), no build has
    failed in this process, and not inside a graph torch.compile traces (its compiler writes
    its own matmuls; an extension call would break the graph: decode/compiled_step.py)."""
    if torch.compiler.is_compiling():
        return False
    return os.environ.get("ATTNLAB_KERNELS", "1") != "0" and _state["broken"] is None


def ready() -> bool:
    """Whether the kernels run here: `available()` once the build (on first use) has worked."""
    if available():
        run("mv_f32", torch.zeros(1, 8), torch.zeros(1, 8))
    return available()


def extension():
    """The built extension module (its kernels and step.cpp's `Step`), or None where it cannot run
    (switched off, or the build failed: said once, then every later call answers None at once)."""
    if not available():
        return None
    try:
        return _ext()
    except Exception as err:  # no compiler, no ninja, a broken toolchain: torch's paths instead
        last = (str(err).strip().splitlines() or ["(no message)"])[-1]
        _state["broken"] = f"{type(err).__name__}: {last[:200]}"
        warnings.warn(
            f"attnlab's matvec kernels could not be built ({_state['broken']}); decoding uses "
            "torch's own matmuls (correct, slower). Install a C++ compiler (g++) and ninja, or "
            "set ATTNLAB_KERNELS=0 to silence this",
            RuntimeWarning,
            stacklevel=4,
        )
        return None


def run(name: str, *args: torch.Tensor) -> torch.Tensor | None:
    """Kernel `name` on args (a matvec: x first, (M, K)), or None where it cannot run
    (`extension()`)."""
    ext = extension()
    return None if ext is None else getattr(ext, name)(*args)


def fp32_rows(x: torch.Tensor, k: int) -> bool:
    """Whether x (..., K) is CPU fp32 rows of length k that no gradient flows through (the
    kernels have no backward)."""
    return (
        x.device.type == "cpu"
        and x.dtype == torch.float32
        and x.shape[-1] == k
        and x.numel() > 0
        and not (torch.is_grad_enabled() and x.requires_grad)
    )


def few_rows(x: torch.Tensor, k: int) -> bool:
    """Whether x (..., K) is at most MAX_ROWS such rows (`fp32_rows`): a decode step's case, the
    one the matvecs serve."""
    return fp32_rows(x, k) and x.numel() <= MAX_ROWS * k


def rows_of(x: torch.Tensor) -> torch.Tensor:
    """x (..., K) -> (M, K), contiguous."""
    return x.reshape(-1, x.shape[-1]).contiguous()


def linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, w, b), through `mv` when x is a few rows (`few_rows`) and w a contiguous fp32
    CPU matrix that needs no gradient; torch's F.linear otherwise."""
    if (
        few_rows(x, w.shape[-1])
        and w.dtype == torch.float32
        and w.device.type == "cpu"
        and w.is_contiguous()
        and not (torch.is_grad_enabled() and w.requires_grad)
    ):
        y = run("mv_f32", rows_of(x), w)
        if y is not None:
            y = y.view(*x.shape[:-1], w.shape[0])
            return y if b is None else y + b
    return F.linear(x, w, b)


def pad_to(x: torch.Tensor, k_padded: int) -> torch.Tensor:
    """x (M, K) -> (M, K') zero-padded to the blocks' K (a padded weight column multiplies 0)."""
    return x if x.shape[-1] == k_padded else F.pad(x, (0, k_padded - x.shape[-1]))


class KernelLinear(torch.nn.Linear):
    """nn.Linear whose few-row products take `mv` (`linear`); `al.fuse` turns a model's plain
    Linear maps into these (the same parameters, only the class changes)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)
