"""A translation run (src/attnlab/train/tasks/translation.py) as an HF folder that transformers
translates with exactly as `attnlab translate` does:

    tok = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForSeq2SeqLM.from_pretrained(folder)       # Marian or Pegasus (bart.py)
    out = model.generate(**tok(sentences, padding=True, return_tensors="pt"))
    tok.batch_decode(out, skip_special_tokens=True)

What makes the two agree, beyond the weights (src/attnlab/interop/bart.py):

- tokenizer.json is the run's joint BPE with a post-processor that appends EOS, the source
  attnlab's collate feeds its encoder (`collate_translation`: ids + EOS, right-padded with the
  pad id); a recipe with `data.lowercase` gets a Lowercase normalizer in front, as `translate`
  lower-cases its input. tokenizer_config.json names the special tokens (PreTrainedTokenizerFast)
  and turns off transformers' clean-up of spaces, which attnlab's decoding does not do.
- config.json and generation_config.json carry the run's token ids (the decoder starts with BOS,
  ends at EOS, pads with the pad id; no forced EOS, which Marian's config defaults to) and its
  `decoding`
  section: num_beams, length_penalty, early_stopping False (attnlab's beam search is
  transformers' with these, src/attnlab/decode/beam.py).
- One thing transformers cannot say: attnlab's length limit grows with the source,
  max_len_a · S + max_len_b new tokens for a batch of padded source length S (EOS included);
  a generation_config holds one number. It gets that bound for the longest training source
  (data.max_len tokens + EOS); `generate(..., max_new_tokens=int(a * S + b))` gives attnlab's
  own limit, which only matters for a hypothesis that has not ended by then.

It reads the run's recipe, so it sits in the train layer; `attnlab convert` calls it for a
translation run (src/attnlab/cli/convert.py).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

from torch import nn

if TYPE_CHECKING:
    from tokenizers import Tokenizer

    from .recipes import Recipe


def translation_recipe(src: Path) -> Recipe | None:
    """The recipe of the translation run (or checkpoint folder) at `src`; None for anything
    else (an HF folder, a .gguf file, another task's run)."""
    from . import checkpoint
    from .recipes import Recipe

    if not src.is_dir():
        return None
    folder = checkpoint.best_or_last(src)
    if folder is None and (src / checkpoint.MANIFEST).exists():
        folder = src
    if folder is None or not (folder / "recipe.json").is_file():
        return None
    raw = checkpoint.load_recipe(folder)
    if (raw.get("data") or {}).get("kind") != "translation":  # other runs: not validated here
        return None
    return Recipe.from_dict(raw)


def save_translation(
    model: nn.Module, tok: Tokenizer, recipe: Recipe, folder: Path, model_type: str
) -> None:
    """Write `model` (a translation run's, with its tokenizer and recipe) into `folder` as the
    HF folder the module docstring describes."""
    from ..atomic import atomic_file
    from ..data import special_ids
    from ..decode.settings import GenerationSettings
    from ..interop import save_pretrained

    ids, dec = special_ids(tok), recipe.decoding
    missing = [r for r in ("pad", "bos", "eos") if r not in ids]
    if missing:
        raise ValueError(
            f"the run's tokenizer has no {', '.join(missing)} token: a translation run's source "
            "ends with EOS and its decoder starts with BOS"
        )
    tokens = dict(
        pad_token_id=ids["pad"],
        bos_token_id=ids["bos"],
        eos_token_id=ids["eos"],
        decoder_start_token_id=ids["bos"],
    )
    model.generation = GenerationSettings(
        **tokens,
        num_beams=dec.num_beams,
        length_penalty=dec.length_penalty,
        early_stopping=False,
        max_new_tokens=int(dec.max_len_a * (recipe.data.max_len + 1) + dec.max_len_b),
    )
    save_pretrained(model, folder, model_type)
    config = json.loads((folder / "config.json").read_text())
    config.update(tokens, forced_eos_token_id=None)  # Marian's config defaults both EOS to 0
    with atomic_file(folder / "config.json") as tmp:
        tmp.write_text(json.dumps(config, indent=2))
    with atomic_file(folder / "tokenizer.json") as tmp:
        hf_tokenizer(tok, ids["eos"], recipe.data.lowercase).save(str(tmp))
    names = {role: tok.id_to_token(i) for role, i in ids.items() if role != "mask"}
    tcfg = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        **{f"{role}_token": name for role, name in names.items()},
        "clean_up_tokenization_spaces": False,
        "padding_side": "right",
    }
    with atomic_file(folder / "tokenizer_config.json") as tmp:
        tmp.write_text(json.dumps(tcfg, indent=2))


def hf_tokenizer(tok: Tokenizer, eos: int, lowercase: bool) -> Tokenizer:
    """`tok` encoding a source as attnlab's encoder reads it: EOS appended, lower-cased first
    when the recipe says so."""
    from tokenizers import Tokenizer, normalizers, processors

    out = Tokenizer.from_str(tok.to_str())
    if lowercase:
        own = out.normalizer
        out.normalizer = (
            normalizers.Lowercase()
            if own is None
            else normalizers.Sequence([normalizers.Lowercase(), own])
        )
    name = tok.id_to_token(eos)
    out.post_processor = processors.TemplateProcessing(
        single=f"$A {name}", pair=f"$A {name} $B {name}", special_tokens=[(name, eos)]
    )
    return out
