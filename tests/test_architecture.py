"""The house rules, checked: registries agree with the config, components refuse typos, no module
imports another in a circle, a new positional scheme or activation needs no edit to build.py,
the block, the stack or the attention layer, and a new attention kind none to ModelConfig's
rules, build.py or presets.tiny (each kind carries its own rules and test size).
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import os
import shutil
import subprocess
import sys
import textwrap
import typing
from pathlib import Path

import pytest
import torch

import attnlab as al
from attnlab import config as C
from attnlab.build import Dims
from attnlab.nn.activations import ACTIVATIONS
from attnlab.nn.attention import ATTENTIONS, FEATURE_MAPS, Attention
from attnlab.nn.block import PLACEMENTS, RESIDUALS, Block
from attnlab.nn.ffn import FFNS, GLUFFN, DenseFFN, MoEFFN
from attnlab.nn.ffn.moe import ROUTINGS
from attnlab.nn.frontends import FRONTENDS
from attnlab.nn.init import INITS
from attnlab.nn.norms import NORMS
from attnlab.nn.positional import POSITIONAL, ROPE_SCALINGS, Rotation
from attnlab.nn.positional.base import LAYOUTS
from attnlab.nn.positional.rope import RotaryEmbedding
from attnlab.nn.positional.sinusoidal import SIN_LAYOUTS, SinusoidalPositions
from attnlab.train.schedules import SCHEDULES
from attnlab.train.specs import ScheduleSpec

PACKAGE = Path(al.__file__).parent


def union_kinds(annotation) -> list[str]:
    """The `kind` of every member of an Annotated[Union[...], discriminator] config union."""
    union = typing.get_args(annotation)[0]
    members = typing.get_args(union) or (union,)  # a union of one is that one class
    return [cls.model_fields["kind"].default for cls in members]


def literal_values(model, field: str) -> list[str]:
    return list(typing.get_args(model.model_fields[field].annotation))


# --- every kind in each config union / Literal is registered, and vice versa --------------------

PAIRS = {
    "positional": (union_kinds(C.Positional), POSITIONAL),
    "attention": (union_kinds(C.AttentionKind), ATTENTIONS),
    "feature map": (list(typing.get_args(C.FeatureMap)), FEATURE_MAPS),
    "rope scaling": (union_kinds(C.RopeScaling), ROPE_SCALINGS),
    "norm": (union_kinds(C.NormConfig), NORMS),
    "ffn": (union_kinds(C.FFN), FFNS),
    "frontend": (union_kinds(C.Frontend), FRONTENDS),
    "activation": (list(typing.get_args(C.Activation)), ACTIVATIONS),
    "init": (literal_values(C.ModelConfig, "init"), INITS),
    "norm_placement": (literal_values(C.ModelConfig, "norm_placement"), PLACEMENTS),
    "residual": (literal_values(C.ModelConfig, "residual"), RESIDUALS),
    "rope layout": (literal_values(C.RoPE, "layout"), LAYOUTS),
    "sinusoidal layout": (literal_values(C.Sinusoidal, "layout"), SIN_LAYOUTS),
    "moe routing": (literal_values(C.MoEFFN, "routing"), ROUTINGS),
    "schedule": (union_kinds(ScheduleSpec), SCHEDULES),
}


@pytest.mark.parametrize("what", list(PAIRS))
def test_config_kinds_and_registries_agree(what: str) -> None:
    kinds, registry = PAIRS[what]
    assert len(kinds) == len(set(kinds))
    assert sorted(kinds) == sorted(registry), f"{what}: config {kinds} vs registered {registry}"


BASES = {
    "positional": (C.Positional, C.PositionalBase),
    "attention": (C.AttentionKind, C.AttentionBase),
    "rope scaling": (C.RopeScaling, C.ScalingBase),
    "norm": (C.NormConfig, C.NormBase),
    "ffn": (C.FFN, C.FFNBase),
    "frontend": (C.Frontend, C.FrontendBase),
}


@pytest.mark.parametrize("what", list(BASES))
def test_every_kind_subclasses_its_unions_base(what: str) -> None:
    """The base gives a kind the defaults ModelConfig and presets.tiny ask every kind for
    (problems, tiny, the declared properties)."""
    union, base = BASES[what]
    for cls in typing.get_args(typing.get_args(union)[0]):
        assert issubclass(cls, base), f"{what} {cls.__name__} must subclass {base.__name__}"


def test_moe_experts_are_registered_dense_ffns() -> None:
    experts = union_kinds(C.MoEFFN.model_fields["expert"].annotation)
    assert set(experts) <= set(FFNS.names()) - {"moe"}


# --- every config field reaches its component ---------------------------------------------------

# fields a config node has only to derive a shared size, with where the size goes instead
DERIVED = {("rope", "fraction"): "rotary_dim", ("glu", "multiple_of"): "d_ff"}
DIMS = {f.name for f in dataclasses.fields(Dims)}
EXTRA = {"norm": {"dim"}, "ffn": {"dropout"}}  # what build.py passes besides fields and dims


@pytest.mark.parametrize("what", ["positional", "rope scaling", "norm", "ffn", "frontend"])
def test_every_config_field_is_a_constructor_argument(what: str) -> None:
    """A field the constructor does not name would be silently ignored; a required parameter
    that no field, dim or build.py extra names would fail at build time."""
    annotation = {"positional": C.Positional, "rope scaling": C.RopeScaling}.get(what)
    annotation = annotation or {"norm": C.NormConfig, "ffn": C.FFN, "frontend": C.Frontend}[what]
    registry = PAIRS[what][1]
    union = typing.get_args(annotation)[0]
    for cls in typing.get_args(union) or (union,):
        kind = cls.model_fields["kind"].default
        params = inspect.signature(registry.get(kind)).parameters
        for field in set(cls.model_fields) - {"kind"}:
            if (kind, field) in DERIVED:
                assert DERIVED[kind, field] in params, (kind, field)
            else:
                assert field in params, f"{what} {kind!r}: field {field!r} reaches no argument"
        offered = set(cls.model_fields) | DIMS | EXTRA.get(what, set())
        for name, p in params.items():
            if p.default is p.empty:
                assert name in offered, f"{what} {kind!r} needs {name!r}, which nothing offers"


def test_init_schemes_take_sizes_not_the_config() -> None:
    """build.py passes each scheme the sizes it names, from Dims (Registry.build)."""
    for name in INITS:
        params = list(inspect.signature(INITS.get(name)).parameters)
        assert params[0] == "model" and set(params[1:]) <= DIMS, (name, params)


NORMS_ALONE = f"""
import sys, types
root = types.ModuleType("attnlab")  # the package without its __init__, which imports build.py
root.__path__ = [{str(PACKAGE)!r}]
sys.modules["attnlab"] = root
from attnlab.nn.norms import NORMS
print(sorted(NORMS))
"""


def test_norms_are_complete_on_import() -> None:
    """NORMS waits for no other module's side-effect import: importing nn/norms.py alone, in a
    fresh interpreter (this one has imported build.py), registers every norm kind."""
    run = subprocess.run([sys.executable, "-c", NORMS_ALONE], capture_output=True, text=True)
    assert run.stdout.strip() == str(sorted(union_kinds(C.NormConfig))), run.stderr[-2000:]


def test_a_component_asking_for_an_unknown_value_names_it() -> None:
    from attnlab.registry import Registry

    reg: Registry = Registry("positional scheme")

    @reg.register("needy")
    def needy(*, d_model: int, n_heds: int):  # a typo in a parameter name
        return d_model, n_heds

    with pytest.raises(ValueError, match=r"'needy' needs 'n_heds'.*offered: .*n_heads"):
        reg.build("needy", {"kind": "needy"}, dataclasses.asdict(Dims(8, 2, 2, 4, 0, 32, 1, True)))


# --- typos fail loudly, whether built from a config or by hand -----------------------------------


def attention(**kw) -> Attention:
    return Attention(d_model=8, n_heads=2, **kw)


def block(**kw) -> Block:
    parts = dict(
        self_attn=attention(), ffn=DenseFFN(d_model=8, d_ff=16), make_norm=torch.nn.Identity
    )
    return Block(**parts, **kw)


TYPOS = {
    "placement": (lambda: block(placement="pre-norm"), "'pre'"),
    "residual": (lambda: block(residual="paralel"), "'parallel'"),
    "kernel": (lambda: attention(kernel="sdpaa"), "'sdpa'"),
    "activation": (lambda: DenseFFN(d_model=8, d_ff=16, activation="gelu_tanh"), "'gelu-tanh'"),
    "glu activation": (lambda: GLUFFN(d_model=8, d_ff=16, activation="swish"), "Known: gelu"),
    "moe routing": (
        lambda: MoEFFN(d_model=8, d_ff=16, expert={"kind": "glu"}, n_experts=2, routing="topk"),
        "'topk-softmax'",
    ),
    "moe expert": (
        lambda: MoEFFN(d_model=8, d_ff=16, expert={"kind": "gelu"}, n_experts=2),
        "'glu'",
    ),
    "rope layout": (lambda: RotaryEmbedding(rotary_dim=8, layout="halves"), "'half'"),
    "rope scaling": (lambda: RotaryEmbedding(rotary_dim=8, scaling={"kind": "yarm"}), "'yarn'"),
    "rotation layout": (
        lambda: Rotation(torch.ones(1, 1, 1), torch.zeros(1, 1, 1), "interleave"),
        "'interleaved'",
    ),
    "sinusoidal layout": (lambda: SinusoidalPositions(d_model=8, layout="splitted"), "'split'"),
}


@pytest.mark.parametrize("what", list(TYPOS))
def test_typos_raise_value_error_with_the_allowed_values(what: str) -> None:
    make, hint = TYPOS[what]
    with pytest.raises(ValueError) as info:
        make()
    assert hint in str(info.value), str(info.value)
    assert "Did you mean" in str(info.value) or "Known:" in str(info.value)


def test_constructors_are_keyword_only() -> None:
    """Positional arguments were how `Block(attn, ffn, norm, "pre-norm")` slipped through."""
    registries = (NORMS, POSITIONAL, FFNS, ROPE_SCALINGS, FRONTENDS)
    registered = [r.get(name) for r in registries for name in r]
    for cls in (Attention, Block, *registered):
        params = list(inspect.signature(cls).parameters.values())
        assert all(p.kind is p.KEYWORD_ONLY for p in params), cls.__name__


# --- no import circles --------------------------------------------------------------------------


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def run_time_nodes(tree: ast.AST) -> list[ast.AST]:
    """ast.walk's nodes less the bodies of `if TYPE_CHECKING:`: imports for annotations only,
    never run, so they close no circle (the config's kinds name ModelConfig in their rules'
    signatures, and config/model.py imports the kinds)."""
    out, todo = [], [tree]
    while todo:
        node = todo.pop()
        out.append(node)
        if isinstance(node, ast.If) and ast.unparse(node.test).endswith("TYPE_CHECKING"):
            todo += node.orelse
        else:
            todo += ast.iter_child_nodes(node)
    return out


def imports_of(path: Path, modules: set[str]) -> set[str]:
    """The attnlab modules a file imports, anywhere in it (function-level imports included),
    but for those under `if TYPE_CHECKING:`."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = set()
    for node in run_time_nodes(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name in modules}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{anchor}.{base}" if base else anchor
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                out.add(sub if sub in modules else base)
    return {m for m in out if m in modules and m != name}


def test_no_import_circles() -> None:
    files = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph = {m: imports_of(p, set(files)) for m, p in files.items()}
    root = PACKAGE.name  # its __init__ re-exports the public API, which is not a dependency
    graph = {m: deps - {root} for m, deps in graph.items()}
    cycles, state = [], {}

    def visit(m: str, path: list[str]) -> None:
        state[m] = "open"
        for d in sorted(graph[m]):
            if state.get(d) == "open":
                cycles.append([*path[path.index(d) :], d])
            elif d not in state:
                visit(d, [*path, d])
        state[m] = "done"

    for m in sorted(graph):
        if m not in state:
            visit(m, [m])
    assert not cycles, "import circles:\n" + "\n".join(" -> ".join(c) for c in cycles)


def test_the_circle_check_skips_only_type_checking_imports() -> None:
    """The kinds' type-only import of ModelConfig is skipped; their run-time imports, and one
    inside a function, are seen."""
    files = {module_name(p) for p in PACKAGE.rglob("*.py")}
    deps = imports_of(PACKAGE / "config/positional.py", files)
    assert deps == {"attnlab.config.base", "attnlab.config.scaling"}, deps
    assert "attnlab.config.positional" in imports_of(PACKAGE / "config/model.py", files)
    probe = "if TYPE_CHECKING:\n    import a\nelse:\n    import b\n\ndef f():\n    import c\n"
    nodes = run_time_nodes(ast.parse(probe))
    seen = {a.name for n in nodes if isinstance(n, ast.Import) for a in n.names}
    assert seen == {"b", "c"}, seen


# --- extensibility: a new scheme and activation touch only their own places ----------------------

KERPLE = '''
"""KERPLE-style logarithmic distance bias (Chi et al. 2022, arXiv:2205.09921), the test's new
scheme: -r1 · log(1 + r2 · |k - q|) per head, learned r1, r2 > 0."""

import torch
from torch import nn

from .base import POSITIONAL, PositionalScheme


@POSITIONAL.register("kerple")
class KerpleLog(PositionalScheme):
    def __init__(self, *, n_heads: int, causal: bool, init_r2: float = 1.0) -> None:
        super().__init__()
        self.causal = causal
        self.r1 = nn.Parameter(torch.ones(n_heads))
        self.r2 = nn.Parameter(torch.full((n_heads,), init_r2))

    def score_bias(self, q_positions, k_positions):
        dist = (k_positions[:, None, :] - q_positions[:, :, None]).abs().float()  # (B, T, S)
        r1, r2 = self.r1[None, :, None, None], self.r2[None, :, None, None]
        return -r1 * torch.log1p(r2 * dist[:, None])  # (B, H, T, S)
'''

KERPLE_CONFIG = '''

class Kerple(PositionalBase):
    """KERPLE logarithmic bias (Chi et al. 2022, arXiv:2205.09921)."""

    kind: Literal["kerple"] = "kerple"
    biases_scores: ClassVar[bool] = True  # what it is, for other kinds' rules to ask
    per_layer: ClassVar[bool] = True  # it acts inside attention: a layer may take it
    init_r2: float = Field(1.0, gt=0)

'''

SQUARED_RELU = '''

@ACTIVATIONS.register("relu2")
def squared_relu(x: torch.Tensor) -> torch.Tensor:
    """relu(x)² (So et al. 2021, Primer, arXiv:2109.08668)."""
    return F.relu(x).square()
'''

CHECK = """
import torch, attnlab as al
from attnlab.config import ModelConfig, DenseFFN
cfg = ModelConfig(arch="decoder", vocab_size=50, d_model=16, n_layers=2, n_heads=2,
                  positional={"kind": "kerple", "init_r2": 0.5}, ffn=DenseFFN(activation="relu2"))
model = al.build_model(cfg)
pos = model.decoder.positional
assert type(pos).__name__ == "KerpleLog" and float(pos.r2[0]) == 0.5, pos
assert model.decoder.blocks[0].ffn.act(torch.tensor([-2.0, 3.0])).tolist() == [0.0, 9.0]
ids = torch.randint(0, 50, (2, 7))
out = model(ids)
out.logits.sum().backward()
assert pos.r1.grad is not None and torch.isfinite(out.logits).all()
# cached decoding equals recomputation, as for every scheme
model.eval()
cache = model.new_cache(2, 7)
step = torch.cat([model(ids[:, i : i + 1], cache=cache).logits for i in range(7)], 1)
torch.testing.assert_close(step, model(ids).logits, rtol=1e-5, atol=1e-5)
# what it declares, other kinds' rules ask: linear attention refuses it, a layer may take it
from attnlab.config import ConfigError, LayerSpec
try:
    cfg.replace(attention={"kind": "linear"})
except ConfigError as e:
    assert "positional ('kerple') adds a bias to the attention scores" in str(e), e
else:
    raise AssertionError("linear attention took a score bias")
assert LayerSpec(positional={"kind": "kerple"}).positional.kind == "kerple"
print("ok")
"""


def _edit(path: Path, old: str, new: str) -> None:
    text = path.read_text()
    assert text.count(old) == 1, (path, old)
    path.write_text(text.replace(old, new))


def _copy_package(tmp_path: Path) -> Path:
    copy = tmp_path / "attnlab"
    shutil.copytree(PACKAGE, copy, ignore=shutil.ignore_patterns("__pycache__"))
    return copy


def _changed(copy: Path) -> set[str]:
    """The files of the copy that differ from the package (or are new)."""
    return {
        str(p.relative_to(copy))
        for p in copy.rglob("*.py")
        if not (PACKAGE / p.relative_to(copy)).exists()
        or (PACKAGE / p.relative_to(copy)).read_bytes() != p.read_bytes()
    }


def _run_in_copy(tmp_path: Path, check: str) -> None:
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    run = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(check)], env=env, capture_output=True, text=True
    )
    assert run.returncode == 0 and run.stdout.strip() == "ok", run.stderr[-3000:]


def test_adding_a_positional_scheme_and_an_activation_touches_only_their_own_places(tmp_path):
    """A contributor's edits, done in a copy of the package: the new module, its config class
    (and its name in the config's union / Literal), one registration line. Then the model builds,
    trains and decodes with them; build.py, the block, the stack and the attention layer are
    byte-for-byte the originals."""
    copy = _copy_package(tmp_path)
    (copy / "nn/positional/kerple.py").write_text(KERPLE)  # 1. its own module
    cfg = copy / "config/positional.py"  # 2. its config class, a member of the union
    _edit(cfg, "\nPositional = Annotated[", KERPLE_CONFIG + "\nPositional = Annotated[")
    _edit(cfg, "NoPositions, XLRelative]", "NoPositions, XLRelative, Kerple]")
    _edit(  # 3. one import line
        copy / "nn/positional/__init__.py",
        "from . import alibi,",
        "from . import kerple  # noqa: F401\nfrom . import alibi,",
    )
    # the activation: its registration, and its name in the config's Literal
    (copy / "nn/activations.py").write_text((copy / "nn/activations.py").read_text() + SQUARED_RELU)
    _edit(
        copy / "config/ffn.py",
        'Activation = Literal["relu",',
        'Activation = Literal["relu2", "relu",',
    )

    assert _changed(copy) == {
        "nn/positional/kerple.py",
        "config/positional.py",
        "config/ffn.py",
        "nn/positional/__init__.py",
        "nn/activations.py",
    }
    _run_in_copy(tmp_path, CHECK)


SIGMOID = '''
"""Sigmoid attention (Ramapuram et al. 2024, arXiv:2409.04431), the test's new attention kind:
weights sigmoid(q·k / sqrt(D) - log(max_len)), no normalisation over the keys; causal only."""

import math

import torch
from torch import nn

from .layer import ATTENTIONS


@ATTENTIONS.register("sigmoid")
class SigmoidAttention(nn.Module):
    cache_kind = "static"

    def __init__(self, *, d_model: int, n_heads: int, head_dim: int, max_len: int) -> None:
        super().__init__()
        self.n_heads, self.head_dim, self.b = n_heads, head_dim, -math.log(max_len)
        self.qkv_proj = nn.Linear(d_model, 3 * n_heads * head_dim)
        self.o_proj = nn.Linear(n_heads * head_dim, d_model)

    def forward(self, x, ctx, memory=None, cache=None, need_weights=False):
        B, T, _ = x.shape
        # (B, T, 3·H·D) -> (3, B, H, T, D)
        q, k, v = self.qkv_proj(x).view(B, T, 3, self.n_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        w = torch.sigmoid(q @ k.transpose(-1, -2) / math.sqrt(self.head_dim) + self.b)  # (B, H, T, T)
        w = w.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), 0.0)
        return self.o_proj((w @ v).transpose(1, 2).reshape(B, T, -1)), None
'''

SIGMOID_CONFIG = '''

class SigmoidAttentionConfig(_NoWindowNoQKNorm, AttentionBase):
    """Sigmoid attention (Ramapuram et al. 2024, arXiv:2409.04431)."""

    kind: Literal["sigmoid"] = "sigmoid"
    max_len: int = Field(gt=1)  # the training length: the bias is -log(max_len)

    def problems(self, model: ModelConfig, where: str) -> list[str]:
        p = []
        if model.arch != "decoder":
            p.append(f"{where}.kind 'sigmoid' needs arch 'decoder' (got {model.arch!r})")
        return p

    def tiny(self, size: TinySize) -> SigmoidAttentionConfig:
        return self.merged(max_len=min(self.max_len, 64))

'''

CHECK_ATTENTION = """
import torch, attnlab as al
from attnlab.config import ConfigError, ModelConfig
cfg = ModelConfig(arch="decoder", vocab_size=50, d_model=16, n_layers=2, n_heads=2,
                  attention={"kind": "sigmoid", "max_len": 4096})
model = al.build_model(cfg)
layer = model.decoder.blocks[0].self_attn
assert type(layer).__name__ == "SigmoidAttention" and layer.b == -torch.log(torch.tensor(4096.0))
out = model(torch.randint(0, 50, (2, 7)))
out.logits.sum().backward()
assert layer.qkv_proj.weight.grad is not None and torch.isfinite(out.logits).all()
# its test size and its rule are the kind's: presets.tiny and ModelConfig only ask it
small = al.presets.tiny(cfg)
assert small.attention.max_len == 64, small.attention
al.build_model(small)
try:
    cfg.replace(arch="encoder")
except ConfigError as e:
    assert e.problems == ["attention.kind 'sigmoid' needs arch 'decoder' (got 'encoder')"], e
else:
    raise AssertionError("the kind's rule did not run")
print("ok")
"""


def test_adding_an_attention_kind_touches_no_central_chain(tmp_path):
    """A new attention kind with a rule and a test size of its own: its module, one import
    line, its config class and its name in the union. ModelConfig's rules, build.py and
    presets.tiny are byte-for-byte the originals, yet validate, build and shrink it."""
    copy = _copy_package(tmp_path)
    (copy / "nn/attention/sigmoid.py").write_text(SIGMOID)
    init = copy / "nn/attention/__init__.py"
    init.write_text(
        init.read_text() + "\nfrom . import sigmoid  # noqa: E402, F401  (registers it)\n"
    )
    cfg = copy / "config/attention.py"
    _edit(cfg, "\nAttentionKind = Annotated[", SIGMOID_CONFIG + "\nAttentionKind = Annotated[")
    _edit(
        cfg,
        "        XLAttentionConfig,\n    ],",
        "        XLAttentionConfig,\n        SigmoidAttentionConfig,\n    ],",
    )
    assert _changed(copy) == {
        "nn/attention/sigmoid.py",
        "nn/attention/__init__.py",
        "config/attention.py",
    }
    _run_in_copy(tmp_path, CHECK_ATTENTION)


# --- kind knowledge sits on the kinds -----------------------------------------------------------


def kind_class_names() -> set[str]:
    """The config classes of every kind of a tagged union, and their bases."""
    out, todo = set(), [C.Kind]
    while todo:
        cls = todo.pop()
        out.add(cls.__name__)
        todo += cls.__subclasses__()
    return out


def kind_tests(tree: ast.AST, kinds: set[str]) -> list[str]:
    """Each `isinstance(x, K)` with K (or one of a tuple of classes) a kind class, and each
    comparison of a `.kind` with a string, in `tree`."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "isinstance":
            classes = node.args[1].elts if isinstance(node.args[1], ast.Tuple) else [node.args[1]]
            names = {getattr(c, "id", getattr(c, "attr", None)) for c in classes}
            found += [f"line {node.lineno}: isinstance(..., {n})" for n in names & kinds]
        elif isinstance(node, ast.Compare):
            sides = [node.left, *node.comparators]
            is_kind = any(isinstance(x, ast.Attribute) and x.attr == "kind" for x in sides)
            if is_kind and any(isinstance(x, ast.Constant) for x in sides):
                found.append(f"line {node.lineno}: {ast.unparse(node)}")
    return found


def test_build_and_the_model_rules_test_no_kind():
    """build.py, ModelConfig's collecting rules, presets.tiny and the preset tables ask each kind
    (its problems(), tiny(), declared properties, words) instead of testing which kind it is, so
    a new kind edits none of them. (Swin's StagesConfig.problems and the frontend rules name the
    kinds they require.)"""
    kinds = kind_class_names()
    old = "ffn = cfg.ffn.expert if isinstance(cfg.ffn, MoEFFN) else cfg.ffn\nrope = pos.kind == 'rope'"
    assert len(kind_tests(ast.parse(old), kinds)) == 2  # what build.py had: the check sees it
    build = ast.parse((PACKAGE / "build.py").read_text())
    assert not kind_tests(build, kinds), kind_tests(build, kinds)
    methods = (C.ModelConfig._problems, C.ModelConfig._kind_problems, al.presets.tiny)
    methods += (C.ModelConfig._layer_problems, C.ModelConfig.rotary_dim.fget)
    methods += (C.ModelConfig.ffn_dim.fget, al.presets.describe, al.presets.components_table)
    for m in methods:
        tree = ast.parse(textwrap.dedent(inspect.getsource(m)))
        assert not kind_tests(tree, kinds), (m.__qualname__, kind_tests(tree, kinds))
