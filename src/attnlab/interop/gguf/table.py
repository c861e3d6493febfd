"""The GGUF architecture table: `general.architecture` -> its entry (`Arch`,
src/attnlab/interop/gguf/archs/base.py), which holds both how the reader undoes what llama.cpp's
converter did to the transformers checkpoint and how the writer does it again. The entries live
in src/attnlab/interop/gguf/archs/, one module per file of llama.cpp's conversion/ package
(llama.py, qwen.py, gemma.py, phi.py, olmo.py, deepseek.py, gpt_oss.py, command_r.py, gpt2.py,
gptneox.py + bloom.py as neox.py, mpt.py, falcon.py); adding an architecture is one entry there
and one name here. The reader and the writer ask an entry, never an architecture's name.
"""

from __future__ import annotations

from .archs.base import Arch
from .archs.command_r import COMMAND_R
from .archs.deepseek import DEEPSEEK2
from .archs.falcon import FALCON
from .archs.gemma import GEMMA2, GEMMA3
from .archs.gpt2 import GPT2
from .archs.gpt_oss import GPT_OSS
from .archs.llama import GRANITE, LLAMA, SMOLLM3
from .archs.mpt import MPT
from .archs.neox import BLOOM, GPTNEOX
from .archs.olmo import OLMO2
from .archs.phi import PHI3
from .archs.qwen import QWEN2, QWEN3, QWEN3MOE

# the order of the listings in messages ("supported: llama, qwen2, ...")
_ENTRIES = (LLAMA, QWEN2, QWEN3, SMOLLM3, GRANITE, GEMMA2, GEMMA3, PHI3, QWEN3MOE, OLMO2, GPT_OSS,
            DEEPSEEK2, COMMAND_R, GPT2, GPTNEOX, MPT, FALCON, BLOOM)  # fmt: skip
ARCHITECTURES: dict[str, Arch] = {a.name: a for a in _ENTRIES}
# transformers model_type -> the architecture it is written as
WRITTEN_AS: dict[str, Arch] = {t: a for a in ARCHITECTURES.values() for t in a.model_types()}


def scalings_note() -> str:
    """Which rope.scaling.type each architecture reads, for a refusal."""
    by_kind: dict[str, list[str]] = {}
    for a in ARCHITECTURES.values():
        for kind in a.scalings:
            by_kind.setdefault(kind, []).append(a.name)
    return ", ".join(
        ["'none' and 'linear' everywhere"]
        + [f"{kind!r} for {' and '.join(names)}" for kind, names in by_kind.items()]
    )
