"""Suite-wide settings. Tiny models are dominated by thread start-up: with pytest-xdist running
one worker per core, one torch thread per worker is fastest (10-70x under load).

A suite started in the background (`nohup make test &`) inherits SIGINT and SIGHUP ignored, and
so would every process a test starts: the Ctrl-C and hang-up tests (test_chat, test_serve_cli,
test_kernel_build) would then wait for a signal that never arrives. The defaults are restored
here, so children start with them."""

import signal

import pytest
import torch

torch.set_num_threads(1)
pytest.register_assert_rewrite("helpers")  # the shared helpers' asserts explain themselves too


def _unfused_flex_is_an_error() -> None:
    """torch runs FlexAttention unfused — the whole fp32 (B, H, T, S) scores — where it is not
    compiled, says so once per process with a warning and goes on. attnlab compiles flex
    itself (src/attnlab/nn/attention/kernels/flex.py), so in this suite the warning is an error
    wherever it fires, except where a test asks for eager flex on purpose (flex.COMPILE off).
    torch's warning is once per process, so the check wraps torch's `_warn_once` itself."""
    from torch.nn.attention import flex_attention as torch_flex

    from attnlab.nn.attention.kernels import flex

    real = torch_flex._warn_once

    def strict(warning_id: str, message: str, *args, **kwargs) -> None:
        if warning_id == "flex_attention_performance" and flex.COMPILE:
            raise AssertionError(f"FlexAttention ran unfused: {message.splitlines()[0]}")
        if warning_id != "flex_attention_performance":
            real(warning_id, message, *args, **kwargs)

    torch_flex._warn_once = strict


_unfused_flex_is_an_error()

for _sig, _default in (
    (signal.SIGINT, signal.default_int_handler),
    (signal.SIGHUP, signal.SIG_DFL),
):
    if signal.getsignal(_sig) == signal.SIG_IGN:
        signal.signal(_sig, _default)


def pytest_terminal_summary(terminalreporter) -> None:
    """The CPU and the kernels this run used, so every result names the machine it held on
    (tolerances: tests/helpers/tolerance.py; `make test` reruns the kernel tests under
    ATEN_CPU_CAPABILITY=avx2). A summary line, so `-q` prints it too."""
    from attnlab.nn.quantize import cpu_has_native_bf16

    model = "unknown CPU"
    try:
        with open("/proc/cpuinfo") as f:
            model = next(
                line.split(":", 1)[1].strip() for line in f if line.startswith("model name")
            )
    except (OSError, StopIteration):
        pass
    terminalreporter.write_line(
        f"cpu: {model}; torch {torch.__version__}, ATen kernels "
        f"{torch.backends.cpu.get_cpu_capability()}, native bf16 {cpu_has_native_bf16()}"
    )


@pytest.fixture
def matvec_calls(monkeypatch):
    """The kernel names `attnlab.nn.matvec.run` is called with, in order (the real kernels run)."""
    from attnlab.nn import matvec

    calls: list[str] = []
    real = matvec.run

    def run(name, *args):
        calls.append(name)
        return real(name, *args)

    monkeypatch.setattr(matvec, "run", run)
    return calls


class DeviceReads:
    """The tensor-to-Python conversions (`item`, `tolist`, `int(t)`, `bool(t)`...) made inside
    `with reads:`; on a GPU each one waits for the device."""

    NAMES = ("item", "tolist", "__float__", "__int__", "__bool__", "__index__")

    def __init__(self) -> None:
        self.names: list[str] = []
        self.on = False

    def __enter__(self) -> "DeviceReads":
        self.on = True
        return self

    def __exit__(self, *exc) -> None:
        self.on = False


@pytest.fixture
def device_reads(monkeypatch):
    """A DeviceReads recording every conversion made inside `with device_reads:`."""
    reads = DeviceReads()
    for name in DeviceReads.NAMES:
        real = getattr(torch.Tensor, name)

        def spy(self, *a, _real=real, _name=name, **kw):
            if reads.on:
                reads.names.append(_name)
            return _real(self, *a, **kw)

        monkeypatch.setattr(torch.Tensor, name, spy)
    return reads
