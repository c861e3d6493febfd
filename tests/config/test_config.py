"""The config tree: validation messages, frozenness, serialisation, derived values, registries.

Every rule in `ModelConfig._problems` has one case below that triggers it alone and checks the
message names the field, the value, the rule and the fix, and that following the fix gives a
valid config. Expected derived sizes come from the reference models' published configs
(Hugging Face `config.json` of the model each preset cites) or from an integer re-derivation of
the formula, never from a print of attnlab itself.
"""

from __future__ import annotations

import inspect
import re

import pydantic
import pytest

import attnlab as al
from attnlab import config as C
from attnlab.config import (
    GLUFFN,
    AttentionConfig,
    ConfigError,
    DenseFFN,
    DynamicNTKScaling,
    LayerNormConfig,
    LearnedPositions,
    LinearScaling,
    ModelConfig,
    MoEFFN,
    NTKScaling,
    RMSNormConfig,
    RoPE,
    Sinusoidal,
    T5RelativeBias,
    YaRNScaling,
)
from attnlab.registry import Registry, UnknownNameError

BASE = dict(arch="decoder", vocab_size=50, d_model=32, n_layers=1, n_heads=4)
# an image encoder (ViT's patch frontend), valid as it is
FRONTEND = dict(
    arch="encoder",
    vocab_size=0,
    positional={"kind": "none"},
    frontend={"kind": "patches", "image_size": 8, "patch_size": 4},
)
# DeepSeek's latent attention and Transformer-XL's pair, valid as they are
MLA = dict(
    positional={"kind": "rope"},
    attention=dict(
        kind="mla", kv_lora_rank=8, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8
    ),
)
XL = dict(positional={"kind": "xl-relative"}, attention={"kind": "xl", "mem_len": 4})
# a speech encoder-decoder (Whisper's audio frontend), valid as it is
AUDIO = dict(
    arch="encoder-decoder",
    positional={"kind": "learned", "max_len": 8},
    frontend={"kind": "audio", "num_mel_bins": 4, "max_source_positions": 4},
)


def problems_of(**changes) -> list[str]:
    """The problems ModelConfig.from_dict reports for BASE with `changes` (must be invalid)."""
    with pytest.raises(ConfigError) as info:
        ModelConfig.from_dict({**BASE, **changes})
    return info.value.problems


def divisors(n: int) -> set[int]:
    return {d for d in range(1, n + 1) if n % d == 0}


def suggested_set(message: str) -> set[int]:
    """The `{a, b, c}` set of choices a message proposes."""
    found = re.search(r"\{([\d, ]+)\}", message)
    assert found, f"no set of choices in: {message}"
    return {int(x) for x in found.group(1).split(",")}


# --- one case per rule of ModelConfig._problems and of each kind's problems() --------------------
# (rule id, bad changes, substrings the message must hold, changes that follow the advised fix)
RULE_CASES = [
    (
        "ntk-needs-four-channels",
        dict(
            positional={"kind": "rope", "fraction": 0.25, "scaling": {"kind": "ntk", "factor": 2.0}}
        ),
        [
            "positional.scaling ('ntk')",
            "at least 4 rotary channels",
            "got 2",
            "raise positional.fraction",
        ],
        dict(
            positional={"kind": "rope", "fraction": 0.5, "scaling": {"kind": "ntk", "factor": 2.0}}
        ),
    ),
    (
        "t5-max-distance",
        dict(positional={"kind": "t5-relative", "num_buckets": 8, "max_distance": 2}),
        ["positional.max_distance (2)", "num_buckets // 2 (4)", "raise max_distance"],
        dict(positional={"kind": "t5-relative", "num_buckets": 8, "max_distance": 5}),
    ),
    (
        "kv-divides-heads",
        dict(d_model=96, n_heads=12, n_kv_heads=5),
        ["n_heads (12)", "n_kv_heads (5)", "divisible", "choose n_kv_heads in"],
        dict(d_model=96, n_heads=12, n_kv_heads=4),
    ),
    (
        "heads-divide-d_model",
        dict(d_model=30, n_heads=4, positional={"kind": "none"}),
        ["d_model (30)", "n_heads (4)", "divisible", "choose n_heads in", "or set head_dim"],
        dict(d_model=30, n_heads=4, head_dim=8, positional={"kind": "none"}),
    ),
    (
        "rope-even-channels",
        dict(positional={"kind": "rope", "fraction": 0.375}),  # head_dim 8 -> 3 channels
        ["positional.fraction (0.375)", "head_dim (8)", "3 rotary channels", "even", ">= 2"],
        dict(positional={"kind": "rope", "fraction": 0.25}),  # 2 channels
    ),
    (
        "learned-offset",
        dict(positional={"kind": "learned", "max_len": 4, "offset": 4}),
        ["positional.offset (4)", "positional.max_len (4)", "smaller", "raise max_len"],
        dict(positional={"kind": "learned", "max_len": 5, "offset": 4}),
    ),
    (
        "parallel-needs-pre",
        dict(residual="parallel", norm_placement="post"),
        ["residual ('parallel')", "norm_placement 'pre'", "use residual 'sequential'"],
        dict(residual="parallel", norm_placement="pre"),
    ),
    (
        "parallel-not-encoder-decoder",
        dict(arch="encoder-decoder", residual="parallel-shared-norm"),
        ["residual ('parallel-shared-norm')", "cross-attention", "use residual 'sequential'"],
        dict(arch="encoder-decoder", residual="sequential"),
    ),
    (
        "moe-top-k",
        dict(ffn={"kind": "moe", "n_experts": 2, "top_k": 3}),
        ["ffn.top_k (3)", "ffn.n_experts (2)", "<=", "lower top_k or add experts"],
        dict(ffn={"kind": "moe", "n_experts": 3, "top_k": 3}),
    ),
    (
        "n_decoder_layers-only-encoder-decoder",
        dict(n_decoder_layers=3),
        ["n_decoder_layers (3)", "only for arch 'encoder-decoder'", "remove it"],
        dict(arch="encoder-decoder", n_decoder_layers=3),
    ),
    (
        "encoder-only-fields",
        dict(arch="encoder-decoder", type_vocab_size=2),
        ["type_vocab_size (2)", "only for arch 'encoder'", "set it to 0"],
        dict(arch="encoder-decoder", type_vocab_size=0),
    ),
    (
        "mlm-head-only-encoder",
        dict(mlm_head=True),
        ["mlm_head (True)", "only for arch 'encoder'", "set it to False"],
        dict(mlm_head=False),
    ),
    (
        "mlm-xor-labels",
        dict(arch="encoder", mlm_head=True, num_labels=3),
        ["mlm_head (True)", "num_labels (3)", "exclude each other", "one model per task"],
        dict(arch="encoder", mlm_head=False, num_labels=3),
    ),
    (
        "sinusoidal-even-d_model",
        dict(d_model=15, n_heads=3),
        ["d_model (15)", "even", "sinusoidal", "change d_model"],
        dict(d_model=16, n_heads=4),
    ),
    (
        "scaled-logits-need-tying",
        dict(scale_tied_logits=True, tie_embeddings=False),
        ["scale_tied_logits (True)", "tie_embeddings (True)", "enable it or drop the scaling"],
        dict(scale_tied_logits=True, tie_embeddings=True),
    ),
    (
        "rounded-embed-scale-needs-scaling",
        dict(round_embed_scale=True),
        ["round_embed_scale (True)", "scale_embeddings (True)", "enable it or drop the rounding"],
        dict(round_embed_scale=True, scale_embeddings=True),
    ),
    (
        "linear-attention-no-score-bias",
        dict(attention={"kind": "linear"}, positional={"kind": "alibi"}),
        ["positional ('alibi')", "attention.kind 'linear'", "use positional 'rope'"],
        dict(attention={"kind": "linear"}, positional={"kind": "rope"}),
    ),
    (
        "longformer-no-score-bias",
        dict(
            arch="encoder",
            attention={"kind": "longformer", "attention_window": 4},
            positional={"kind": "alibi"},
        ),
        [
            "positional ('alibi')",
            "attention.kind 'longformer'",
            "global rows apart",
            "use positional 'learned'",
        ],
        dict(
            arch="encoder",
            attention={"kind": "longformer", "attention_window": 4},
            positional={"kind": "learned", "max_len": 64},
        ),
    ),
    (
        "block-sparse-encoder-only",
        dict(attention={"kind": "block-sparse", "block_size": 4}),
        [
            "attention.kind 'block-sparse'",
            "needs arch 'encoder'",
            "(got 'decoder')",
            "use attention.kind 'softmax'",
        ],
        dict(attention={"kind": "softmax"}),
    ),
    (
        "longformer-encoder-only",
        dict(attention={"kind": "longformer", "attention_window": 4}),
        [
            "attention.kind 'longformer'",
            "needs arch 'encoder'",
            "(got 'decoder')",
            "use attention.kind 'softmax'",
        ],
        dict(attention={"kind": "softmax", "sliding_window": 3}),
    ),
    (
        "pad-in-vocab",
        dict(pad_token_id=50),
        ["pad_token_id (50)", "vocab_size (50)", "< vocab_size", "fix the id"],
        dict(pad_token_id=49),
    ),
    (
        "token-ids-need-vocab",
        dict(vocab_size=0),
        ["vocab_size (0)", "must be > 0", "set vocab_size, or a frontend"],
        dict(vocab_size=1),
    ),
    (
        "frontend-encoder-only",
        {**FRONTEND, "arch": "decoder"},
        ["frontend ('patches')", "only for arch 'encoder'", "(got 'decoder')", "drop the frontend"],
        FRONTEND,
    ),
    (
        "frontend-no-vocab",
        {**FRONTEND, "vocab_size": 10},
        ["vocab_size (10)", "must be 0", "set vocab_size to 0"],
        FRONTEND,
    ),
    (
        "frontend-own-positions",
        {**FRONTEND, "positional": {"kind": "learned", "max_len": 5}},
        ["positional ('learned')", "must be 'none'", "its own learned positions", "set positional"],
        FRONTEND,
    ),
    (
        "audio-frontend-needs-vocab",
        {**AUDIO, "vocab_size": 0},
        ["vocab_size (0)", "must be > 0 with frontend 'audio'", "set vocab_size"],
        AUDIO,
    ),
    (
        "audio-frontend-one-token-table",
        {**AUDIO, "share_encoder_decoder_embeddings": False},
        ["share_encoder_decoder_embeddings (False)", "the decoder's is the only one", "True"],
        AUDIO,
    ),
    (
        "encoder-no-lm-logits",
        dict(arch="encoder", logit_multiplier=0.5),
        ["logit_multiplier (0.5)", "arch 'encoder'", "remove it"],
        dict(arch="encoder"),
    ),
    (
        "frontend-no-token-fields",
        {**FRONTEND, "pad_token_id": 0},
        ["pad_token_id (0)", "describes token embeddings", "remove it"],
        FRONTEND,
    ),
    (
        "mla-own-kv-heads",
        {**MLA, "n_kv_heads": 2},
        ["n_kv_heads (2)", "must be unset with attention.kind 'mla'", "remove n_kv_heads"],
        MLA,
    ),
    (
        "mla-own-head-dim",
        {**MLA, "head_dim": 8},
        ["head_dim (8)", "does not apply to attention.kind 'mla'", "remove head_dim"],
        MLA,
    ),
    (
        "mla-no-cross-attention",
        {**MLA, "arch": "encoder-decoder"},
        ["attention.kind 'mla'", "no cross-attention form", "use arch 'decoder'"],
        {**MLA, "arch": "decoder"},
    ),
    (
        "xl-relative-needs-xl-attention",
        {"positional": XL["positional"]},
        [
            "positional 'xl-relative'",
            "needs attention.kind 'xl'",
            "(got 'softmax')",
            "set attention",
        ],
        XL,
    ),
    (
        "xl-attention-needs-xl-relative",
        {"attention": XL["attention"]},
        ["attention.kind 'xl'", "needs positional 'xl-relative'", "(got 'sinusoidal')"],
        XL,
    ),
    (
        "xl-decoder-only",
        {**XL, "arch": "encoder"},
        ["attention.kind 'xl'", "needs arch 'decoder'", "(got 'encoder')"],
        XL,
    ),
    (
        "xl-relative-even-d_model",
        {**XL, "d_model": 33, "n_heads": 3},
        ["d_model (33)", "even", "'xl-relative'", "change d_model"],
        {**XL, "d_model": 32, "n_heads": 4},
    ),
]


def kind_classes() -> list[type]:
    """Every kind of the config's tagged unions (config.Kind's subclasses), the bases included."""
    out, todo = [], [C.Kind]
    while todo:
        cls = todo.pop()
        out.append(cls)
        todo += cls.__subclasses__()
    return out


@pytest.mark.parametrize(
    ("rule", "bad", "parts", "fixed"), RULE_CASES, ids=[c[0] for c in RULE_CASES]
)
def test_rule_reports_field_value_rule_and_fix(rule, bad, parts, fixed):
    problems = problems_of(**bad)
    assert len(problems) == 1, problems  # the case breaks this rule and no other
    for part in parts:
        assert part in problems[0], f"{part!r} missing from: {problems[0]}"
    ModelConfig.from_dict({**BASE, **fixed})  # the advised fix gives a valid config


def test_every_rule_has_a_case():
    # One `p.append(` per rule in _problems and in each kind's own problems(): a new rule
    # without a case above fails here.
    rules = [ModelConfig._problems, ModelConfig._frontend_problems]
    rules += [k.__dict__["problems"] for k in kind_classes() if "problems" in k.__dict__]
    n_rules = sum(inspect.getsource(m).count("p.append(") for m in rules)
    assert len({c[0] for c in RULE_CASES}) == n_rules


def test_head_divisibility_message_is_the_documented_one():
    # The exact example of the README ("Use it").
    assert problems_of(d_model=96, n_heads=12, n_kv_heads=5) == [
        "n_heads (12) must be divisible by n_kv_heads (5): choose n_kv_heads in {1, 2, 3, 4, 6, 12}"
    ]


@pytest.mark.parametrize(("n_heads", "n_kv_heads"), [(12, 5), (8, 3), (7, 2), (30, 4)])
def test_suggested_kv_heads_are_exactly_the_valid_ones(n_heads, n_kv_heads):
    (msg,) = problems_of(n_heads=n_heads, n_kv_heads=n_kv_heads, head_dim=4)
    choices = suggested_set(msg)
    assert choices == divisors(n_heads)
    for kv in choices:
        ModelConfig.from_dict({**BASE, "n_heads": n_heads, "n_kv_heads": kv, "head_dim": 4})


@pytest.mark.parametrize(("d_model", "n_heads"), [(30, 4), (100, 8), (96, 7)])
def test_suggested_n_heads_are_exactly_the_valid_ones(d_model, n_heads):
    (msg,) = problems_of(d_model=d_model, n_heads=n_heads)
    choices = suggested_set(msg)
    assert choices == divisors(d_model)
    for h in choices:
        ModelConfig.from_dict({**BASE, "d_model": d_model, "n_heads": h})


@pytest.mark.parametrize("field", ["type_vocab_size", "num_labels"])
@pytest.mark.parametrize("arch", ["decoder", "encoder-decoder"])
def test_encoder_only_sizes_rejected_elsewhere(field, arch):
    (msg,) = problems_of(arch=arch, **{field: 2})
    assert f"{field} (2)" in msg and "only for arch 'encoder'" in msg and "set it to 0" in msg
    ModelConfig.from_dict({**BASE, "arch": "encoder", field: 2})  # fine on an encoder


def test_rope_with_no_rotated_channel_is_rejected():
    # head_dim 8 * 0.1 -> 0 channels: even, but RoPE would rotate nothing.
    (msg,) = problems_of(positional={"kind": "rope", "fraction": 0.1})
    assert "0 rotary channels" in msg and ">= 2" in msg


def test_all_problems_reported_together():
    with pytest.raises(ConfigError) as info:
        ModelConfig.from_dict(
            {
                **BASE,
                "arch": "encoder-decoder",
                "d_model": 30,
                "n_heads": 4,
                "n_kv_heads": 3,
                "norm_placement": "post",
                "residual": "parallel",
                "ffn": {"kind": "moe", "n_experts": 1, "top_k": 2},
                "type_vocab_size": 1,
                "pad_token_id": 99,
            }
        )
    problems = info.value.problems
    expected = [
        "n_kv_heads (3)",
        "d_model (30) must be divisible by n_heads (4)",
        "needs norm_placement 'pre'",
        "not defined with cross-attention",
        "ffn.top_k (2)",
        "type_vocab_size (1)",
        "pad_token_id (99)",
    ]
    assert len(problems) == len(expected), problems
    for part in expected:
        assert sum(part in p for p in problems) == 1, (part, problems)
    text = str(info.value)
    assert f"({len(expected)} problem(s))" in text
    assert all(p in text for p in problems)


def test_all_field_errors_reported_together():
    with pytest.raises(ConfigError) as info:
        ModelConfig.from_dict(
            {
                "arch": "decoder",
                "vocab_size": -1,
                "d_model": 0,
                "n_heads": 4,
                "attention": {"dropout": 1.5, "qkv_bais": True},
                "dropuot": 0.1,
            }
        )
    problems = info.value.problems
    for where in ("vocab_size = -1", "d_model = 0", "n_layers", "attention.softmax.dropout = 1.5"):
        assert any(p.startswith(where) for p in problems), (where, problems)
    assert any(p.startswith("attention.softmax.qkv_bais: unknown field") for p in problems)
    assert any(p.startswith("dropuot: unknown field") for p in problems)
    assert len(problems) == 6, problems


# --- field-level errors ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("changes", "start", "words"),
    [
        (dict(d_model=-8), "d_model = -8", ["greater than 0"]),
        (dict(n_layers=0), "n_layers = 0", ["greater than 0"]),
        (dict(n_kv_heads=-1), "n_kv_heads = -1", ["greater than 0"]),
        (dict(dropout=1.0), "dropout = 1.0", ["less than 1"]),
        (dict(d_model="wide"), "d_model = 'wide'", ["integer"]),
        (dict(arch="decoder-only"), "arch = 'decoder-only'", ["'encoder'", "'decoder'"]),
        (
            dict(attention={"sliding_window": 0}),  # no kind: softmax attention
            "attention.softmax.sliding_window = 0",
            ["greater than"],
        ),
        (dict(norm={"kind": "rmsnorm", "eps": 0}), "norm.rmsnorm.eps = 0", ["greater than 0"]),
        (
            dict(
                positional={
                    "kind": "rope",
                    "scaling": {"kind": "yarn", "factor": 1.0, "original_max_len": 8},
                }
            ),
            "positional.rope.scaling.yarn.factor = 1.0",
            ["greater than 1"],
        ),
        (
            dict(ffn={"kind": "moe", "n_experts": 4, "expert": {"kind": "glu", "multiple_of": 0}}),
            "ffn.moe.expert.glu.multiple_of = 0",
            ["greater than 0"],
        ),
        (dict(ffn={"kind": "dense", "activation": "tanh"}), "ffn.dense.activation", ["'relu'"]),
        (dict(foo=1), "foo: unknown field", ["remove it"]),
        (dict(attention={"window": 4}), "attention.softmax.window: unknown field", ["remove it"]),
        (
            dict(positional={"kind": "alibi", "base": 2.0}),
            "positional.alibi.base: unknown field",  # a RoPE field cannot sit on ALiBi
            ["remove it"],
        ),
        (
            dict(positional={"kind": "learned"}),
            "positional.learned.max_len: required field is missing",
            ["set it"],
        ),
        (
            dict(positional={"kind": "rotary"}),
            "positional = {'kind': 'rotary'}",
            ["'rotary'", "'rope'", "'alibi'", "'sinusoidal'"],
        ),
        (dict(ffn={"kind": "swiglu"}), "ffn = {'kind': 'swiglu'}", ["'glu'", "'moe'"]),
        (dict(norm={"eps": 1e-5}), "norm = {'eps': 1e-05}", ["kind"]),
    ],
)
def test_field_errors_name_the_path(changes, start, words):
    problems = problems_of(**changes)
    assert len(problems) == 1, problems
    assert problems[0].startswith(start), problems
    for w in words:
        assert w in problems[0], (w, problems[0])


@pytest.mark.parametrize("field", ["arch", "vocab_size", "d_model", "n_layers", "n_heads"])
def test_missing_required_field(field):
    data = {k: v for k, v in BASE.items() if k != field}
    with pytest.raises(ConfigError) as info:
        ModelConfig.from_dict(data)
    assert info.value.problems == [f"{field}: required field is missing (set it)"]


@pytest.mark.parametrize(
    ("make", "start"),
    [
        (lambda: RoPE(fraction=2), "fraction = 2"),
        (lambda: RoPE(layout="split"), "layout = 'split'"),
        (lambda: LearnedPositions(max_len=0), "max_len = 0"),
        (lambda: LearnedPositions(), "max_len: required field is missing"),
        (lambda: T5RelativeBias(num_buckets=2), "num_buckets = 2"),
        (lambda: YaRNScaling(factor=0.5, original_max_len=8), "factor = 0.5"),
        (lambda: LinearScaling(factor=0), "factor = 0"),
        (lambda: DynamicNTKScaling(factor=2.0, original_max_len=0), "original_max_len = 0"),
        (lambda: AttentionConfig(dropout=-0.1), "dropout = -0.1"),
        (lambda: AttentionConfig(scale=0), "scale = 0"),
        (lambda: LayerNormConfig(eps=-1), "eps = -1"),
        (lambda: MoEFFN(n_experts=4, top_k=0), "top_k = 0"),
        (lambda: MoEFFN(n_experts=4, n_shared_experts=-1), "n_shared_experts = -1"),
        (lambda: GLUFFN(activation="swish"), "activation = 'swish'"),
        (lambda: DenseFFN(bias=True, gate=True), "gate: unknown field"),
        (lambda: Sinusoidal(kind="rope"), "kind = 'rope'"),
        (lambda: ModelConfig(**BASE, n_kv_heads=3), "n_heads (4) must be divisible"),
    ],
)
def test_sub_configs_constructed_directly_raise_config_error(make, start):
    with pytest.raises(ConfigError) as info:
        make()
    assert info.value.problems[0].startswith(start), info.value.problems
    assert isinstance(info.value, ValueError)
    assert not isinstance(info.value, pydantic.ValidationError)


@pytest.mark.parametrize(
    ("cls", "data"),
    [
        (ModelConfig, {**BASE, "n_kv_heads": 3}),
        (ModelConfig, {**BASE, "d_model": "x"}),
        (ModelConfig, [1, 2]),
        (ModelConfig, None),
        (RoPE, {"fraction": 2}),
        (MoEFFN, {"n_experts": 2, "top_k": "two"}),
    ],
)
def test_from_dict_raises_config_error_not_validation_error(cls, data):
    with pytest.raises(ConfigError) as info:
        cls.from_dict(data)
    assert not isinstance(info.value, pydantic.ValidationError)
    assert info.value.problems


def test_replace_validates():
    cfg = ModelConfig(**BASE)
    with pytest.raises(ConfigError, match=r"n_kv_heads \(3\)"):
        cfg.replace(n_kv_heads=3)
    with pytest.raises(ConfigError, match="n_head: unknown field"):
        cfg.replace(n_head=8)
    rope = cfg.replace(positional=RoPE(fraction=0.5))
    assert rope.positional == RoPE(fraction=0.5) and cfg.positional == Sinusoidal()


# --- frozen, no unknown keys ---------------------------------------------------------------------


def test_configs_are_frozen():
    cfg = ModelConfig(**BASE, attention=AttentionConfig(qk_norm=False))
    with pytest.raises(ValueError, match="frozen"):
        cfg.d_model = 64
    with pytest.raises(ValueError, match="frozen"):
        cfg.attention.qk_norm = True
    with pytest.raises(ValueError, match="frozen"):
        cfg.positional.base = 2.0
    assert cfg.d_model == 32 and cfg.attention.qk_norm is False
    assert cfg.positional.base == Sinusoidal().base


@pytest.mark.parametrize(
    "make",
    [
        lambda: ModelConfig(**BASE, n_head=4),
        lambda: AttentionConfig(qkv_bias=True, bias=True),
        lambda: RoPE(theta=10000.0),
        lambda: MoEFFN(n_experts=2, experts=2),
        lambda: YaRNScaling(factor=2.0, original_max_len=8, mscale=1.0),
        lambda: RMSNormConfig(eps=1e-6, bias=False),  # LayerNorm-only field on RMSNorm
    ],
)
def test_unknown_keys_rejected(make):
    with pytest.raises(ConfigError, match="unknown field"):
        make()


# --- serialisation -------------------------------------------------------------------------------

PRESET_CONFIGS = [
    pytest.param(name, tiny, id=f"{name}{'-tiny' if tiny else ''}")
    for name in al.presets.names()
    for tiny in (False, True)
]

SCALED_ROPES = [
    RoPE(scaling=LinearScaling(factor=4.0)),
    RoPE(layout="interleaved", scaling=NTKScaling(factor=2.5)),
    RoPE(fraction=0.5, scaling=DynamicNTKScaling(factor=2.0, original_max_len=16)),
    RoPE(base=1e6, scaling=YaRNScaling(factor=8.0, original_max_len=32, beta_fast=16.0)),
]


def preset_config(name: str, tiny: bool) -> ModelConfig:
    cfg = al.presets.get(name)
    return al.presets.tiny(cfg) if tiny else cfg


def assert_round_trips(cfg: ModelConfig) -> None:
    js = cfg.to_json()
    back = ModelConfig.from_json(js)
    assert back == cfg and back.to_json() == js
    ym = cfg.to_yaml()
    back = ModelConfig.from_yaml(ym)
    assert back == cfg and back.to_yaml() == ym
    assert back.to_dict() == cfg.to_dict()


@pytest.mark.parametrize(("name", "tiny"), PRESET_CONFIGS)
def test_preset_round_trips_json_and_yaml(name, tiny):
    assert_round_trips(preset_config(name, tiny))


@pytest.mark.parametrize("rope", SCALED_ROPES, ids=lambda r: r.scaling.kind)
def test_rope_scalings_round_trip(rope):
    cfg = ModelConfig(**BASE, positional=rope)
    assert_round_trips(cfg)
    assert type(ModelConfig.from_json(cfg.to_json()).positional.scaling) is type(rope.scaling)


def test_moe_with_dense_expert_round_trips():
    cfg = ModelConfig(
        **BASE,
        ffn=MoEFFN(expert=DenseFFN(activation="gelu"), n_experts=4, routing="softmax-topk"),
    )
    assert_round_trips(cfg)
    assert isinstance(ModelConfig.from_yaml(cfg.to_yaml()).ffn.expert, DenseFFN)


@pytest.mark.parametrize("suffix", [".json", ".yaml", ".yml"])
@pytest.mark.parametrize(("name", "tiny"), PRESET_CONFIGS)
def test_load_from_file(tmp_path, name, tiny, suffix):
    cfg = preset_config(name, tiny)
    path = tmp_path / f"model{suffix}"
    path.write_text(cfg.to_json() if suffix == ".json" else cfg.to_yaml())
    assert ModelConfig.load(path) == cfg
    assert ModelConfig.load(str(path)) == cfg


def test_load_invalid_file_raises_config_error(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("arch: decoder\nvocab_size: 50\nd_model: 32\nn_layers: 1\nn_heads: 3\n")
    with pytest.raises(ConfigError, match=r"d_model \(32\) must be divisible by n_heads \(3\)"):
        ModelConfig.load(path)


# --- derived values ------------------------------------------------------------------------------
# Published sizes: HF config.json of each model (num_key_value_heads, hidden_size //
# num_attention_heads, intermediate_size, rotary_pct, num_decoder_layers).


@pytest.mark.parametrize(
    ("name", "kv_heads", "head_dim", "rotary_dim", "ffn_dim"),
    [
        ("llama2-7b", 32, 128, 128, 11008),  # Llama-2-7b-hf intermediate_size 11008
        ("llama2-70b", 8, 128, 128, 28672),  # explicit d_ff
        ("mistral-7b", 8, 128, 128, 14336),
        ("mixtral-8x7b", 8, 128, 128, 14336),  # per expert
        ("gpt2-small", 12, 64, 0, 3072),  # GPT-2 n_inner None -> 4 * n_embd
        ("gpt-neox-20b", 64, 96, 24, 24576),  # rotary_pct 0.25 of 96; 4 * 6144
        ("falcon-7b", 1, 64, 64, 18176),  # head_dim 64 with 71 heads; 4 * 4544
        ("bert-base", 12, 64, 0, 3072),
    ],
)
def test_derived_values_of_presets(name, kv_heads, head_dim, rotary_dim, ffn_dim):
    cfg = al.presets.get(name)
    assert (cfg.kv_heads, cfg.attn_head_dim, cfg.rotary_dim, cfg.ffn_dim) == (
        kv_heads,
        head_dim,
        rotary_dim,
        ffn_dim,
    )


def test_kv_heads_and_head_dim_defaults():
    cfg = ModelConfig(**BASE)
    assert cfg.kv_heads == 4 and cfg.attn_head_dim == 8
    cfg = ModelConfig(**{**BASE, "n_kv_heads": 2, "head_dim": 12})
    assert cfg.kv_heads == 2 and cfg.attn_head_dim == 12


@pytest.mark.parametrize("fraction", [0.25, 0.5, 0.75, 1.0])
def test_rotary_dim(fraction):
    cfg = ModelConfig(**{**BASE, "head_dim": 16}, positional=RoPE(fraction=fraction))
    assert cfg.rotary_dim == 16 * fraction
    assert ModelConfig(**BASE, positional={"kind": "alibi"}).rotary_dim == 0


def test_dense_ffn_dim_is_four_d_model_unless_set():
    assert ModelConfig(**BASE).ffn_dim == 4 * 32
    assert ModelConfig(**BASE, d_ff=40).ffn_dim == 40
    assert ModelConfig(**BASE, ffn=GLUFFN(), d_ff=40).ffn_dim == 40
    moe = MoEFFN(expert=DenseFFN(), n_experts=2)
    assert ModelConfig(**BASE, ffn=moe).ffn_dim == 4 * 32


@pytest.mark.parametrize("multiple_of", [1, 8, 64, 256])
def test_glu_ffn_dim_rule(multiple_of):
    # Llama: the smallest multiple of `multiple_of` >= 2/3 · 4 · d (integer arithmetic here).
    for d in range(2, 600, 2):
        expected = -(-8 * d // (3 * multiple_of)) * multiple_of
        cfg = ModelConfig(
            arch="decoder",
            vocab_size=8,
            d_model=d,
            n_layers=1,
            n_heads=1,
            ffn=GLUFFN(multiple_of=multiple_of),
        )
        assert cfg.ffn_dim == expected, d
        moe = cfg.replace(ffn=MoEFFN(expert=GLUFFN(multiple_of=multiple_of), n_experts=2))
        assert moe.ffn_dim == expected, d


def test_decoder_layers():
    cfg = ModelConfig(**{**BASE, "arch": "encoder-decoder", "n_layers": 3})
    assert cfg.decoder_layers == 3
    assert cfg.replace(n_decoder_layers=5).decoder_layers == 5
    assert al.presets.get("t5-small").decoder_layers == 6  # T5 num_decoder_layers = num_layers


# --- registry ------------------------------------------------------------------------------------


def make_registry() -> Registry[int]:
    reg: Registry[int] = Registry("widget")
    for i, name in enumerate(["alpha", "alpine", "beta"]):
        reg.register(name)(i)
    return reg


def test_registry_lookup():
    reg = make_registry()
    assert reg.get("alpine") == 1 and reg.names() == ["alpha", "alpine", "beta"]
    assert "beta" in reg and "gamma" not in reg and list(reg) == reg.names()


def test_registry_unknown_name_lists_known_and_close_matches():
    reg = make_registry()
    with pytest.raises(UnknownNameError) as info:
        reg.get("alpah")
    msg = str(info.value)
    assert msg.startswith("unknown widget 'alpah'")
    assert "Did you mean 'alpha'" in msg
    assert "Known: alpha, alpine, beta" in msg
    assert isinstance(info.value, KeyError)
    with pytest.raises(UnknownNameError) as info:
        reg.get("zzzz")
    assert "Did you mean" not in str(info.value) and "Known: alpha, alpine, beta" in str(info.value)


def test_registry_duplicate_registration_raises():
    reg = make_registry()
    with pytest.raises(ValueError, match="widget 'beta' is already registered"):
        reg.register("beta")(99)
    assert reg.get("beta") == 2


def test_unknown_preset_suggests_close_names():
    with pytest.raises(UnknownNameError) as info:
        al.presets.get("llama2-7")
    msg = str(info.value)
    assert "'llama2-7b'" in msg.split("Known:")[0]
    assert all(name in msg for name in al.presets.names())
