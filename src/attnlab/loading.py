"""A model from any of the places it can live, as one record (`LoadedModel`,
src/attnlab/interop/loaded.py): the loader below `attnlab generate`, `chat`, `convert` and `serve`.

    a run directory   `attnlab train`'s output (or one of its checkpoint folders), with the
                      tokenizer.json the run saved (src/attnlab/train/run.py)
    an HF folder      config.json + *.safetensors + tokenizer.json (+ tokenizer_config.json with
                      the chat template and special tokens, generation_config.json), read
                      without transformers (src/attnlab/interop/pretrained.py)
    a .gguf file      llama.cpp's format: weights, tokenizer and chat template in one file
                      (src/attnlab/interop/gguf/reader.py, imported only for such a path)

    m = load_model("runs/my-run")           # m.model, m.tokenizer, m.chat_template, m.name, ...

The record never says where the model came from. Which models a command takes is the command's
business (`attnlab serve` and `generate` take decoder-only ones: src/attnlab/cli/serve.py,
src/attnlab/cli/generate.py; `convert` any the converters write).
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from .interop.loaded import LoadedModel

# special-token spellings tried when a folder does not say which token ends a sequence
_EOS_NAMES = ("</s>", "<|endoftext|>", "<|im_end|>", "<|eot_id|>", "[SEP]")
_BOS_NAMES = ("<s>", "<|begin_of_text|>", "<|startoftext|>", "[CLS]")

Source = Literal["gguf", "hf", "run"]


def source_of(path: Path) -> Source:
    """Which of the three places `path` is (a checkpoint folder is a run's), or FileNotFoundError
    naming what it is not."""
    if path.suffix == ".gguf":
        if not path.is_file():
            raise FileNotFoundError(f"{path} does not exist")
        return "gguf"
    if not path.exists():
        raise FileNotFoundError(
            f"{path} does not exist: pass a run directory, an HF-format folder (config.json + "
            f"*.safetensors) or a .gguf file"
        )
    if not path.is_dir():
        raise FileNotFoundError(
            f"{path} is neither a folder nor a .gguf file: pass a run directory, an HF-format "
            "folder (config.json + *.safetensors) or a GGUF file"
        )
    hf_config = (path / "config.json").exists() and not (path / "manifest.json").exists()
    if hf_config and any(path.glob("*.safetensors")):  # a checkpoint folder holds both as well
        return "hf"
    if hf_config and "model_type" in _read_json(path / "config.json"):
        raise FileNotFoundError(  # an HF folder (transformers' config.json) whose weights never came
            f"{path} has an HF config.json but no weights (*.safetensors): a write was "
            "interrupted or the download is incomplete; write or download the folder again"
        )
    return "run"


def load_model(path: str | Path, name: str | None = None, packed: bool = False) -> LoadedModel:
    """The model at `path` (run directory, checkpoint folder, HF folder or .gguf file) in eval
    mode with its tokenizer, chat template and special tokens; `name` overrides its name.
    `packed`: a .gguf file's block-quantized weights stay in their blocks (`load_gguf(packed=True)`,
    which reads the scales the file states); other sources ignore it."""
    path = Path(path)
    source = source_of(path)
    if source == "gguf":
        from .interop.gguf import load_gguf

        loaded = load_gguf(path, packed=packed)
        loaded.name = path.stem  # a name a user can type (general.name has spaces and capitals)
    elif source == "hf":
        loaded = _hf_folder(path)
    else:
        loaded = _run_dir(path)
    if name:
        loaded.name = name
    loaded.model.eval()
    return loaded


def _read_json(path: Path) -> dict:
    """A folder's JSON object file, {} where there is none; FileFormatError naming it otherwise."""
    from .interop.pretrained import read_json_object

    return read_json_object(path, path.name) if path.is_file() else {}


def _ids(value, key: str, path: Path) -> list[int]:
    """A token id or a list of them (`eos_token_id`), checked: FileFormatError naming the file,
    the key and the value otherwise."""
    from .errors import FileFormatError, excerpt

    ids = [] if value is None else value if isinstance(value, list) else [value]
    if not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids):
        raise FileFormatError(
            f"{path}: {key} = {excerpt(value, 80)!r} is not a token id (an integer >= 0, or a "
            "list of them): correct it, or save or download the checkpoint again"
        )
    return ids


def _content(token) -> str | None:
    """tokenizer_config.json writes special tokens as a string or as {"content": ...}."""
    token = token.get("content") if isinstance(token, dict) else token
    return token if isinstance(token, str) else None


def _first_known(tok, names) -> int | None:
    for n in names:
        if n and tok.token_to_id(n) is not None:
            return tok.token_to_id(n)
    return None


def _template(value, path: Path) -> str | None:
    """tokenizer_config.json's chat_template: a string, or named ones
    ([{"name": "default", "template": ...}]), of which the default."""
    if isinstance(value, list):
        value = next(
            (
                t.get("template")
                for t in value
                if isinstance(t, dict) and t.get("name") == "default"
            ),
            None,
        )
    if value is not None and not isinstance(value, str):
        from .errors import FileFormatError

        raise FileFormatError(
            f"{path}: chat_template is a JSON {type(value).__name__}, not a template (a string, or "
            'a list of {"name": ..., "template": ...}): correct it, or save the tokenizer again'
        )
    return value


def _hf_folder(folder: Path) -> LoadedModel:
    from .interop import load_pretrained, pretrained_tokenizer

    # the small files first, each checked, so that a broken one is named before the weights load
    tcfg = _read_json(folder / "tokenizer_config.json")
    template = _template(tcfg.get("chat_template"), folder / "tokenizer_config.json")
    if (folder / "chat_template.jinja").is_file():  # transformers >= 4.43 saves it apart
        template = (folder / "chat_template.jinja").read_text()
    gen, cfg = _read_json(folder / "generation_config.json"), _read_json(folder / "config.json")

    def stated(key: str) -> list[int]:  # generation_config.json first, as transformers reads
        for name, d in (("generation_config.json", gen), ("config.json", cfg)):
            if key in d:
                return _ids(d[key], key, folder / name)
        return []

    eos, bos = stated("eos_token_id"), stated("bos_token_id")
    model = load_pretrained(folder)
    tok = pretrained_tokenizer(folder)
    if not eos and (e := _first_known(tok, [_content(tcfg.get("eos_token")), *_EOS_NAMES])):
        eos = [e]
    bos = bos[0] if bos else _first_known(tok, [_content(tcfg.get("bos_token")), *_BOS_NAMES])
    return LoadedModel(
        model=model,
        tokenizer=tok,
        chat_template=template,
        bos_token_id=bos,
        eos_token_ids=eos,
        name=folder.name,
        context_length=cfg.get("max_position_embeddings", cfg.get("n_positions")),
    )


def _run_dir(path: Path) -> LoadedModel:
    from tokenizers import Tokenizer

    from .train import checkpoint

    folder = checkpoint.best_or_last(path) or path
    model, _ = checkpoint.load(folder)
    for cand in (folder / "tokenizer.json", folder.parent / "tokenizer.json"):
        if cand.is_file():
            tok = Tokenizer.from_file(str(cand))
            break
    else:
        raise FileNotFoundError(
            f"no tokenizer.json in {folder} or {folder.parent}: the model needs its tokenizer"
        )
    eos = _first_known(tok, _EOS_NAMES)
    return LoadedModel(
        model=model,
        tokenizer=tok,
        chat_template=None,
        bos_token_id=_first_known(tok, _BOS_NAMES),
        eos_token_ids=[] if eos is None else [eos],
        name=path.name,
    )
