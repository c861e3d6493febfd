"""Bad inputs fail at the model's edge with a message naming the problem and the fix.

Never a bare IndexError or RuntimeError from deep inside an embedding or a matmul: each case
checks the exception type (ValueError / TypeError / KeyError) and the words of the message.
Limits (vocabulary size, position-table length) are read from the config, not pasted.
"""

from __future__ import annotations

import pytest
import torch

import attnlab as al
from attnlab.registry import UnknownNameError

KINDS = {"decoder": "gpt2-small", "encoder": "bert-base", "encoder-decoder": "bart-base"}


def tiny_model(preset: str):
    torch.manual_seed(0)
    cfg = al.presets.tiny(al.presets.get(preset))
    return al.build_model(cfg).eval(), cfg


@pytest.fixture(scope="module")
def models():
    return {kind: tiny_model(name) for kind, name in KINDS.items()}


def call(model, cfg, ids, **kw):
    """Run a model of any arch on `ids` (also used as decoder inputs for encoder-decoders)."""
    if cfg.arch == "encoder-decoder":
        dec = kw.pop("decoder_input_ids", torch.zeros(ids.shape[0], 3, dtype=torch.long))
        return model(ids, dec, **kw)
    return model(ids, **kw)


def expect(exc, fn, *parts):
    """fn() raises `exc` (never IndexError/RuntimeError) whose message holds every part."""
    with pytest.raises(Exception) as info:
        fn()
    err = info.value
    assert isinstance(err, exc), f"{type(err).__name__}: {err}"
    assert not isinstance(err, (IndexError, RuntimeError)), f"{type(err).__name__}: {err}"
    msg = str(err)
    for part in parts:
        assert part in msg, f"{part!r} missing from: {msg}"
    return msg


# --- input_ids -----------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
def test_float_ids(models, kind):
    model, cfg = models[kind]
    ids = torch.ones(2, 4)
    expect(TypeError, lambda: call(model, cfg, ids), "input_ids", "torch.float32", ".long()")


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("shape", [(5,), (1, 2, 5)], ids=["rank1", "rank3"])
def test_ids_of_wrong_rank(models, kind, shape):
    model, cfg = models[kind]
    ids = torch.zeros(shape, dtype=torch.long)
    expect(ValueError, lambda: call(model, cfg, ids), "input_ids", "2-D", str(shape), "ids[None]")


@pytest.mark.parametrize("kind", KINDS)
def test_empty_sequence(models, kind):
    model, cfg = models[kind]
    ids = torch.zeros(2, 0, dtype=torch.long)
    expect(ValueError, lambda: call(model, cfg, ids), "input_ids", "empty", "at least one token")


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("offset", [0, 7], ids=["vocab_size", "beyond"])
def test_id_too_large(models, kind, offset):
    model, cfg = models[kind]
    bad = cfg.vocab_size + offset
    ids = torch.tensor([[1, 2, bad, 3]])
    msg = expect(ValueError, lambda: call(model, cfg, ids), "input_ids", f"id {bad}")
    assert f"vocab_size {cfg.vocab_size}" in msg and f"0..{cfg.vocab_size - 1}" in msg


@pytest.mark.parametrize("kind", KINDS)
def test_negative_id(models, kind):
    model, cfg = models[kind]
    ids = torch.tensor([[1, -3, 2]])
    expect(ValueError, lambda: call(model, cfg, ids), "id -3", f"vocab_size {cfg.vocab_size}")


def test_ids_as_list(models):
    model, _ = models["decoder"]
    expect(TypeError, lambda: model([[1, 2, 3]]), "input_ids", "torch.Tensor", "list")


@pytest.mark.parametrize(
    ("ids", "parts"),
    [
        (torch.ones(1, 3), ["decoder_input_ids", "torch.float32", ".long()"]),
        (torch.zeros(3, dtype=torch.long), ["decoder_input_ids", "2-D"]),
        (torch.zeros(1, 0, dtype=torch.long), ["decoder_input_ids", "empty"]),
        (torch.tensor([[0, 256]]), ["decoder_input_ids", "id 256", "vocab_size 256"]),
        (torch.tensor([[0, -1]]), ["decoder_input_ids", "id -1"]),
    ],
    ids=["float", "rank1", "empty", "too-large", "negative"],
)
def test_bad_decoder_input_ids(models, ids, parts):
    model, cfg = models["encoder-decoder"]
    assert cfg.vocab_size == 256  # the id in the "too-large" case is vocab_size itself
    src = torch.zeros(1, 4, dtype=torch.long)
    expect((TypeError, ValueError), lambda: model(src, ids), *parts)


# --- learned position tables ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kind", "side"),
    [*((kind, "input") for kind in KINDS), ("encoder-decoder", "decoder")],
)
def test_sequence_longer_than_learned_table(models, kind, side):
    model, cfg = models[kind]
    limit = cfg.positional.max_len - cfg.positional.offset  # usable rows of the table
    ok = torch.zeros(1, limit, dtype=torch.long)
    long = torch.zeros(1, limit + 1, dtype=torch.long)
    if side == "decoder":
        src = torch.zeros(1, 4, dtype=torch.long)
        model(src, ok)  # exactly the limit is fine
        fn = lambda: model(src, long)  # noqa: E731
    else:
        call(model, cfg, ok)
        fn = lambda: call(model, cfg, long)  # noqa: E731
    expect(ValueError, fn, f"holds {limit} positions", f"{limit} tokens", "'rope'", "'alibi'")


# --- masks, token types --------------------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("shape", [(2, 4), (2, 6), (1, 5), (2, 1, 5)])
def test_attention_mask_of_wrong_shape(models, kind, shape):
    model, cfg = models[kind]
    ids = torch.zeros(2, 5, dtype=torch.long)
    mask = torch.ones(shape, dtype=torch.long)
    expect(
        ValueError,
        lambda: call(model, cfg, ids, attention_mask=mask),
        "attention_mask",
        "(2, 5)",
        str(tuple(shape)),
    )


def test_decoder_attention_mask_of_wrong_shape(models):
    model, _ = models["encoder-decoder"]
    src, dec = torch.zeros(2, 5, dtype=torch.long), torch.zeros(2, 3, dtype=torch.long)
    mask = torch.ones(2, 5, dtype=torch.long)  # the source's shape, not the target's
    expect(
        ValueError,
        lambda: model(src, dec, decoder_attention_mask=mask),
        "decoder_attention_mask",
        "(2, 3)",
        "(2, 5)",
    )


@pytest.mark.parametrize("bad", [2, 5, -1])
def test_token_type_ids_out_of_range(models, bad):
    model, cfg = models["encoder"]
    n = cfg.type_vocab_size
    ids = torch.zeros(1, 4, dtype=torch.long)
    types = torch.tensor([[0, 1, bad, 0]])
    # The limit is type_vocab_size, not the token vocabulary: the message must say so.
    expect(
        ValueError,
        lambda: model(ids, token_type_ids=types),
        "token_type_ids",
        f"id {bad}",
        f"type_vocab_size {n}",
    )


def test_token_type_ids_of_wrong_shape(models):
    model, _ = models["encoder"]
    ids = torch.zeros(2, 5, dtype=torch.long)
    types = torch.zeros(2, 4, dtype=torch.long)
    expect(ValueError, lambda: model(ids, token_type_ids=types), "token_type_ids", "(2, 5)")


def test_token_type_ids_without_type_embeddings():
    cfg = al.presets.tiny(al.presets.get("bert-base")).replace(type_vocab_size=0)
    model = al.build_model(cfg)
    ids = torch.zeros(1, 4, dtype=torch.long)
    msg = expect(
        ValueError,
        lambda: model(ids, token_type_ids=torch.zeros_like(ids)),
        "token_type_ids",
        "type_vocab_size",
    )
    # ... and the fix: drop the argument, or configure type embeddings.
    assert any(w in msg for w in ("remove", "drop", "omit", "set type_vocab_size")), msg


# --- encoder-decoder -----------------------------------------------------------------------------


def test_encoder_decoder_without_decoder_inputs(models):
    model, _ = models["encoder-decoder"]
    ids = torch.zeros(1, 4, dtype=torch.long)
    expect(ValueError, lambda: model(ids), "decoder_input_ids", "shift_right")


def test_decode_with_memory_of_wrong_width(models):
    model, cfg = models["encoder-decoder"]
    dec = torch.zeros(2, 3, dtype=torch.long)
    memory = torch.zeros(2, 5, cfg.d_model + 1)
    expect(ValueError, lambda: model.decode(dec, memory), "memory", str(cfg.d_model))


# --- building ------------------------------------------------------------------------------------


def test_build_model_with_a_dict():
    data = al.presets.get("gpt2-small").to_dict()
    expect(TypeError, lambda: al.build_model(data), "ModelConfig", "dict", "from_dict")


def test_unknown_preset_name():
    msg = expect(UnknownNameError, lambda: al.presets.get("gpt2-smal"), "unknown preset")
    assert "Did you mean 'gpt2-small'" in msg
    assert all(name in msg for name in al.presets.names())
