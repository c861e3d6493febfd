"""What `attnlab serve MODEL` serves, from any of the three places a model can live:

    a run directory   `attnlab train`'s output (or one of its checkpoint folders), with the
                      tokenizer.json the run saved (src/attnlab/train/run.py)
    an HF folder      config.json + *.safetensors + tokenizer.json (+ tokenizer_config.json with
                      the chat template and special tokens, generation_config.json), read
                      without transformers (src/attnlab/interop/pretrained.py)
    a .gguf file      llama.cpp's format: weights, tokenizer and chat template in one file
                      (src/attnlab/interop/gguf.py, imported only for such a path)

Each gives the same record (`ServedModel`, the fields of interop.gguf.GGUFModel), so the server
never asks where the model came from. Only decoder-only (causal LM) models are served: the
engine continues a prompt token by token. A translation run (encoder-decoder) or an encoder run
is refused as soon as its checkpoint is read, with the command that does use it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torch import nn

# special-token spellings tried when a folder does not say which token ends a sequence
_EOS_NAMES = ("</s>", "<|endoftext|>", "<|im_end|>", "<|eot_id|>", "[SEP]")
_BOS_NAMES = ("<s>", "<|begin_of_text|>", "<|startoftext|>", "[CLS]")


@dataclass
class ServedModel:
    model: nn.Module
    tokenizer: Any  # tokenizers.Tokenizer
    chat_template: str | None
    bos_token_id: int | None
    eos_token_ids: list[int]
    name: str
    context_length: int | None = None  # positions the model was trained for, if it says

    def token(self, i: int | None) -> str:
        """The text of special token `i` (what chat templates call bos_token / eos_token)."""
        return "" if i is None else (self.tokenizer.id_to_token(i) or "")


def load_served(path: str | Path, name: str | None = None, packed: bool = False) -> ServedModel:
    """The model at `path` (run directory, checkpoint folder, HF folder or .gguf file) in eval
    mode with its tokenizer, chat template and special tokens; `name` overrides its name.
    `packed`: a .gguf file's block-quantized weights stay in their blocks (`load_gguf(packed=True)`,
    which reads the scales the file states); other sources ignore it."""
    path = Path(path)
    if path.suffix == ".gguf":
        if not path.is_file():
            raise FileNotFoundError(f"{path} does not exist")
        from ..interop.gguf import load_gguf

        g = load_gguf(path, packed=packed)
        arch = g.metadata.get("general.architecture")
        served = ServedModel(
            g.model,
            g.tokenizer,
            g.chat_template,
            g.bos_token_id,
            list(g.eos_token_ids),
            path.stem,  # a name a user can type (general.name has spaces and capitals)
            g.metadata.get(f"{arch}.context_length"),
        )
    elif not path.exists():
        raise FileNotFoundError(
            f"{path} does not exist: pass a run directory, an HF-format folder (config.json + "
            f"*.safetensors) or a .gguf file"
        )
    elif not path.is_dir():
        raise FileNotFoundError(
            f"{path} is neither a folder nor a .gguf file: pass a run directory, an HF-format "
            "folder (config.json + *.safetensors) or a GGUF file"
        )
    elif (
        (path / "config.json").exists()
        and any(path.glob("*.safetensors"))
        and not (path / "manifest.json").exists()  # a checkpoint folder holds both as well
    ):
        served = _hf_folder(path)
    elif (
        (path / "config.json").exists()
        and "model_type" in _read_json(path / "config.json")
        and not (path / "manifest.json").exists()
    ):  # an HF folder (transformers' config.json) whose weights never arrived
        raise FileNotFoundError(
            f"{path} has an HF config.json but no weights (*.safetensors): a write was "
            "interrupted or the download is incomplete; write or download the folder again"
        )
    else:
        served = _run_dir(path)
    if name:
        served.name = name
    served.model.eval()
    return served


def _read_json(path: Path) -> dict:
    return json.loads(path.read_text()) if path.is_file() else {}


def _ids(value) -> list[int]:
    if value is None:
        return []
    return [int(v) for v in value] if isinstance(value, list) else [int(value)]


def _content(token) -> str | None:
    """tokenizer_config.json writes special tokens as a string or as {"content": ...}."""
    return token.get("content") if isinstance(token, dict) else token


def _first_known(tok, names) -> int | None:
    for n in names:
        if n and tok.token_to_id(n) is not None:
            return tok.token_to_id(n)
    return None


def _hf_folder(folder: Path) -> ServedModel:
    from ..interop import load_pretrained, pretrained_tokenizer

    model = load_pretrained(folder)
    _check_servable(model, folder, run=False)
    tok = pretrained_tokenizer(folder)
    tcfg = _read_json(folder / "tokenizer_config.json")
    template = tcfg.get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": "default", "template": ...}]
        template = next((t["template"] for t in template if t.get("name") == "default"), None)
    if (folder / "chat_template.jinja").is_file():  # transformers >= 4.43 saves it apart
        template = (folder / "chat_template.jinja").read_text()
    gen, cfg = _read_json(folder / "generation_config.json"), _read_json(folder / "config.json")
    eos = _ids(gen.get("eos_token_id", cfg.get("eos_token_id")))
    if not eos and (e := _first_known(tok, [_content(tcfg.get("eos_token")), *_EOS_NAMES])):
        eos = [e]
    bos = gen.get("bos_token_id", cfg.get("bos_token_id"))
    if bos is None:
        bos = _first_known(tok, [_content(tcfg.get("bos_token")), *_BOS_NAMES])
    context = cfg.get("max_position_embeddings", cfg.get("n_positions"))
    return ServedModel(model, tok, template, bos, eos, folder.name, context)


def _check_servable(model: nn.Module, path: Path, run: bool) -> None:
    """ValueError naming what `path` holds and what to use instead, unless it is decoder-only."""
    from ..nn.model import DecoderOnlyModel, EncoderDecoderModel

    if isinstance(model, DecoderOnlyModel):
        return
    head = f"attnlab serve serves decoder-only (causal LM) models; {path} holds"
    if isinstance(model, EncoderDecoderModel):
        use = (
            f'translate with it: attnlab translate {path} "a sentence"'
            if run
            else "decode it in Python per request: attnlab.generate"
        )
        raise ValueError(f"{head} an encoder-decoder (translation) model: {use}")
    use = f"evaluate it with attnlab eval {path}" if run else "it has no next token to generate"
    raise ValueError(f"{head} an encoder ({type(model).__name__}), which generates no text: {use}")


def _run_dir(path: Path) -> ServedModel:
    from tokenizers import Tokenizer

    from ..train import checkpoint

    folder = checkpoint.best_or_last(path) or path
    model, _ = checkpoint.load(folder)
    _check_servable(model, path, run=True)
    for cand in (folder / "tokenizer.json", folder.parent / "tokenizer.json"):
        if cand.is_file():
            tok = Tokenizer.from_file(str(cand))
            break
    else:
        raise FileNotFoundError(
            f"no tokenizer.json in {folder} or {folder.parent}: the model needs its tokenizer"
        )
    eos = _first_known(tok, _EOS_NAMES)
    return ServedModel(
        model, tok, None, _first_known(tok, _BOS_NAMES), [] if eos is None else [eos], path.name
    )
