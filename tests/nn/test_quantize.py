"""Weight-only quantization (src/attnlab/nn/quantize.py) against its formula and the float model.

- int8: scales, rounding and the dequantized weights against a float64 evaluation of the formula
  (s_n = bf16(max_k |W_nk| / 127), q = round-half-even(W / s) in [-127, 127]); each element moves
  at most half a step.
- Int8Linear: a decode step's rows (≤ 8) take the int8 matvec (tests/nn/test_matvec.py checks its
  numbers), more rows the dequantized matmul exactly (K not a multiple of 32, no native bf16) or
  torch's bf16 kernel (native bf16 only), within bf16 rounding of the same matmul on bf16-rounded
  inputs, in float64; without any kernel (ATTNLAB_KERNELS=0, no bf16) a dequantized copy, with a
  warning.
- state dicts: the dequantized weights under the original names; loading float weights
  quantizes them; fused then quantized equals quantized unfused (scales are per output row);
  a quantized tied head adds no name and is re-made from a loaded table.
- whole models: on the fallback path a quantized model decodes exactly the tokens of the float
  model that holds the dequantized weights; routers, embeddings, norms and (by default) the head
  stay as they were.
- bad input: an unknown mode (did-you-mean), quantizing twice, fusing after quantizing; bf16
  without native bf16 warns (the detection is monkeypatched); the detection reads the CPU's
  flags at run time.
"""

from __future__ import annotations

import copy
import warnings
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import attnlab as al
from attnlab.nn import quantize as qmod
from attnlab.nn.quantize import Bf16Linear, Int8Linear

KERNEL = qmod._INT8_MM is not None and qmod.cpu_has_native_bf16()


def _linear(n: int, k: int, bias: bool = True, seed: int = 0) -> nn.Linear:
    torch.manual_seed(seed)
    lin = nn.Linear(k, n, bias=bias)
    with torch.no_grad():
        lin.weight[0] = 0  # an all-zero row: scale tiny, q all zero
        lin.weight[1, 3] = 5.0  # an outlier sets its row's scale
    return lin


def _reference(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The formula in float64: scales (N,), q (N, K) and a mask of the elements within 1e-9 of a
    rounding tie (where float32 division may land on either side)."""
    w64 = w.double()
    s = (w64.abs().amax(dim=1).clamp(min=1e-30) / 127).to(torch.bfloat16).double()
    ratio = w64 / s[:, None]
    q = torch.round(ratio).clamp(-127, 127)
    near_tie = ((ratio - ratio.floor()) - 0.5).abs() < 1e-9
    return s, q, near_tie


def _nolog(module_fn):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        return module_fn()


@pytest.mark.parametrize("n, k", [(24, 64), (7, 40), (33, 96)])
def test_int8_scales_rounding_and_dequantized_weights_follow_the_formula(n, k):
    lin = _linear(n, k)
    m = Int8Linear(lin)
    s, q, near_tie = _reference(lin.weight.detach())
    assert m.qweight.dtype == torch.int8 and m.qweight.shape == (n, k)
    assert torch.equal(m.scales.double(), s)
    assert torch.equal(m.scales_bf16.double(), s)  # the kernel's scales are the same numbers
    got = m.qweight.double()
    off = got != q
    assert not (off & ~near_tie).any(), "q differs from round(W / s) away from a tie"
    assert ((got - q).abs() <= 1).all()
    assert got.abs().max() <= 127 and got[0].abs().max() == 0
    deq = m.dequantized()
    assert deq.dtype == torch.float32
    assert torch.equal(deq.double(), got * s[:, None])  # s · q is exact in float32
    # each element moves at most half a step (a step a little larger than max/127 after bf16)
    err = (deq.double() - lin.weight.double()).abs()
    assert (err <= s[:, None] / 2 + 1e-12).all()
    assert (m.bias == lin.bias).all()


def test_int8_rows_of_a_prefill_are_the_dequantized_matmul_exactly():
    lin = _linear(48, 64)
    m = Int8Linear(lin)
    m.use_kernel = False  # as on a CPU without native bf16
    x = torch.randn(3, 5, 64)  # 15 rows: more than a decode step's
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the kernels are there: nothing to say
        y = m(x)
    assert torch.equal(y, F.linear(x, m.dequantized(), lin.bias))


def test_without_any_kernel_a_dequantized_copy_is_multiplied(monkeypatch):
    monkeypatch.setenv("ATTNLAB_KERNELS", "0")
    lin = _linear(16, 40)
    m = Int8Linear(lin)
    assert not m.use_kernel  # K = 40: torch's kernel is wrong for such K (module docstring)
    x = torch.randn(2, 40)
    with pytest.warns(RuntimeWarning, match="K = 40 is not a multiple of 32.*dequantized copy"):
        y = m(x)
    assert torch.equal(y, F.linear(x, m.dequantized(), lin.bias))
    assert m._dense.dtype == torch.float32  # made once, kept


@pytest.mark.skipif(qmod._INT8_MM is None, reason="this torch has no aten._weight_int8pack_mm")
@pytest.mark.parametrize("rows", [1, 7, 64])
def test_int8_kernel_path_is_the_dequantized_matmul_within_bf16_rounding(rows, monkeypatch):
    """On every CPU: where bf16 is not native the module keeps the kernel off (it would be slow,
    not wrong), so the test switches it on to check the kernel's numbers all the same (and the
    matvec kernels off, which would take the few-row cases)."""
    monkeypatch.setenv("ATTNLAB_KERNELS", "0")
    lin = _linear(96, 128)
    m = Int8Linear(lin)
    assert m.use_kernel == KERNEL, m.no_kernel_because  # on exactly where bf16 is native
    m.use_kernel = True
    x = torch.randn(rows, 128)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the kernel path does not warn
        y = m(x)
    assert y.dtype == x.dtype and y.shape == (rows, 96)
    xb = x.to(torch.bfloat16).double()  # the kernel reads x rounded to bf16
    want = xb @ m.dequantized().double().T + lin.bias.double()
    # the product is rounded to bf16 (2^-9 relative) after an fp32 accumulation: bound the error
    # by 2^-8 of the sum of magnitudes, which holds for any cancellation
    bound = 2**-8 * (xb.abs() @ m.dequantized().double().abs().T) + 1e-6
    assert ((y.double() - want).abs() <= bound).all()


def test_bf16_linear_is_the_matmul_of_bf16_rounded_inputs():
    lin = _linear(32, 64)
    m = Bf16Linear(lin)
    x = torch.randn(4, 64)
    y = m(x)
    w = lin.weight.detach().to(torch.bfloat16).double()
    want = x.to(torch.bfloat16).double() @ w.T + lin.bias.double()
    bound = 2**-8 * (x.to(torch.bfloat16).double().abs() @ w.abs().T) + 1e-6
    assert y.dtype == torch.float32 and ((y.double() - want).abs() <= bound).all()
    assert torch.equal(m.state_dict()["weight"], lin.weight.detach().to(torch.bfloat16).float())


# --- whole models --------------------------------------------------------------------------------


def _tiny(preset: str = "llama2-7b", seed: int = 0, d_model: int = 64, **fields) -> nn.Module:
    torch.manual_seed(seed)
    cfg = al.presets.tiny(al.presets.get(preset), d_model=d_model)
    return al.build_model(cfg.replace(init="xavier", **fields)).eval()


def _fallback(monkeypatch) -> None:
    """Quantize as on a CPU without native bf16 nor the matvec kernels: every Int8Linear takes
    the exact path (torch's matmul with the dequantized weights)."""
    monkeypatch.setattr(qmod, "cpu_has_native_bf16", lambda: False)
    monkeypatch.setenv("ATTNLAB_KERNELS", "0")
    warnings.simplefilter("ignore", RuntimeWarning)


def test_state_dict_holds_the_dequantized_weights_under_the_original_names():
    model = _tiny()
    q = _nolog(lambda: al.quantize(copy.deepcopy(model), "int8"))
    sd, want = q.state_dict(), model.state_dict()
    assert list(sd) == list(want)
    quantized = {n for n, m in q.named_modules() if isinstance(m, Int8Linear)}
    assert quantized and all(sd[f"{n}.weight"].dtype == torch.float32 for n in quantized)
    for key, value in sd.items():
        module = key.rsplit(".", 1)[0]
        if module in quantized and key.endswith("weight"):
            assert torch.equal(value, q.get_submodule(module).dequantized())
            assert not torch.equal(value, want[key])  # it was quantized
        else:
            assert torch.equal(value, want[key]), key  # embeddings, norms: untouched


def test_loading_float_weights_quantizes_them():
    model = _tiny(seed=0)
    want = _nolog(lambda: al.quantize(copy.deepcopy(model), "int8"))
    other = _nolog(lambda: al.quantize(_tiny(seed=1), "int8"))  # different weights
    other.load_state_dict(model.state_dict())
    for (n, a), (_, b) in zip(want.named_buffers(), other.named_buffers(), strict=True):
        assert torch.equal(a, b), n
    with pytest.raises(RuntimeError, match="size mismatch"):
        other.load_state_dict(_tiny(d_model=96).state_dict())


def test_quantized_model_decodes_as_the_float_model_of_its_dequantized_weights(monkeypatch):
    _fallback(monkeypatch)
    model = _tiny()
    q = al.quantize(copy.deepcopy(model), "int8")
    deq = copy.deepcopy(model)
    deq.load_state_dict(q.state_dict())  # a float model holding exactly s · q
    ids = torch.randint(0, model.vocab_size, (2, 7), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(q(ids).logits, deq(ids).logits)
    assert torch.equal(al.generate(q, ids, 12), al.generate(deq, ids, 12))


def test_fuse_then_quantize_equals_quantize_unfused(monkeypatch):
    _fallback(monkeypatch)
    model = _tiny()
    plain = al.quantize(copy.deepcopy(model), "int8")
    fused = al.quantize(al.fuse(copy.deepcopy(model)), "int8")
    assert any(hasattr(m, "layout") for m in fused.modules() if isinstance(m, Int8Linear))
    a, b = plain.state_dict(), fused.state_dict()
    assert list(a) == list(b)  # fused maps export their unfused names, in order
    for key in a:  # scales are per output row, so quantizing the concatenation changes nothing
        assert torch.equal(a[key], b[key]), key
    ids = torch.randint(0, model.vocab_size, (1, 9), generator=torch.Generator().manual_seed(1))
    assert torch.equal(al.generate(plain, ids, 10), al.generate(fused, ids, 10))
    with pytest.raises(ValueError, match="fuse the model before quantizing"):
        al.fuse(plain)


def test_routers_embeddings_norms_and_head_stay_float():
    model = _tiny("mixtral-8x7b", tie_embeddings=False)
    q = _nolog(lambda: al.quantize(copy.deepcopy(model), "int8"))
    routers = [n for n, m in q.named_modules() if n.endswith("router")]
    assert routers and all(type(q.get_submodule(n)) is nn.Linear for n in routers)
    assert type(q.lm_head) is nn.Linear and type(q.embed_tokens) is nn.Embedding
    experts = [m for n, m in q.named_modules() if ".experts." in n and isinstance(m, Int8Linear)]
    assert experts  # the experts' maps are quantized
    sd, want = q.state_dict(), model.state_dict()
    for key in want:
        if "router" in key or "norm" in key or "embed" in key or key.startswith("lm_head"):
            assert torch.equal(sd[key], want[key]), key
    q2 = _nolog(lambda: al.quantize(copy.deepcopy(model), "int8", head=True))
    assert isinstance(q2.lm_head, Int8Linear) and not q2.lm_head.tied


def test_tied_head_is_a_quantized_copy_with_no_name_of_its_own(monkeypatch):
    _fallback(monkeypatch)
    model = _tiny(tie_embeddings=True)
    assert model.lm_head is None
    q = al.quantize(copy.deepcopy(model), "int8", head=True)
    assert isinstance(q.lm_head, Int8Linear) and q.lm_head.tied
    assert list(q.state_dict()) == list(model.state_dict())  # no lm_head.* key
    ids = torch.randint(0, model.vocab_size, (1, 6), generator=torch.Generator().manual_seed(2))
    head = Int8Linear(_as_linear(model.embed_tokens.weight))  # the table, quantized
    with torch.no_grad():
        out = q(ids)
        assert torch.equal(out.logits, F.linear(out.hidden, head.dequantized()))
    # loading a new table re-makes the copy from it
    other = _tiny(seed=5, tie_embeddings=True)
    q.load_state_dict(other.state_dict())
    fresh = Int8Linear(_as_linear(other.embed_tokens.weight))
    assert torch.equal(q.lm_head.qweight, fresh.qweight)
    assert torch.equal(q.embed_tokens.weight, other.embed_tokens.weight)  # the lookup stays float


def _as_linear(w: torch.Tensor) -> nn.Linear:
    lin = nn.Linear(w.shape[1], w.shape[0], bias=False)
    with torch.no_grad():
        lin.weight.copy_(w)
    return lin


# --- bad input and the CPU check -----------------------------------------------------------------


def test_bad_modes_and_orders_are_refused():
    model = _tiny()
    with pytest.raises(ValueError, match=r"mode must be one of 'int8', 'int4', 'bf16'.*int8"):
        al.quantize(model, "int9")
    with pytest.raises(TypeError, match=r"torch\.nn\.Module"):
        al.quantize("model", "int8")
    q = _nolog(lambda: al.quantize(model, "int8"))
    with pytest.raises(ValueError, match="already quantized"):
        al.quantize(q, "bf16")
    with pytest.raises(ValueError, match="quantized"):
        al.unfuse(q)


def test_bf16_without_native_bf16_warns(monkeypatch):
    monkeypatch.setattr(qmod, "cpu_has_native_bf16", lambda: False)
    with pytest.warns(RuntimeWarning, match="no native bf16"):
        al.quantize(_tiny(), "bf16")
    m = Int8Linear(_linear(8, 64))
    assert not m.use_kernel  # and int8 falls back to the exact path


def test_native_bf16_is_read_from_the_cpu_at_run_time(monkeypatch):
    probe = getattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", None)
    if probe is not None and not probe():
        pytest.skip("oneDNN has no bf16 here: the answer is False whatever the flags")
    cpuinfo = {"text": "flags\t: fpu sse2 avx512f avx512bw avx512_bf16 avx512_vnni\n"}
    monkeypatch.setattr(qmod.Path, "read_text", lambda self: cpuinfo["text"])
    qmod.cpu_has_native_bf16.cache_clear()
    try:
        assert qmod.cpu_has_native_bf16()
        cpuinfo["text"] = "flags\t: fpu sse2 avx512f avx512bw avx512_vnni\n"
        qmod.cpu_has_native_bf16.cache_clear()
        assert not qmod.cpu_has_native_bf16()
    finally:
        qmod.cpu_has_native_bf16.cache_clear()


def test_no_kernel_warning_names_the_callers_line(monkeypatch):
    """Without a usable kernel (K = 40 for torch's, the matvec kernels off) quantize warns once,
    at the user's own call: the warning's file is this test, not torch's module.py; the forward
    pass then stays quiet."""
    monkeypatch.setenv("ATTNLAB_KERNELS", "0")
    model = torch.nn.Sequential(torch.nn.Linear(40, 16))
    with pytest.warns(RuntimeWarning, match="K = 40 is not a multiple of 32") as caught:
        al.quantize(model, "int8")
    assert [Path(w.filename).name for w in caught] == [Path(__file__).name]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model(torch.randn(2, 40))
