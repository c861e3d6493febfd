"""Every converter refuses, in a ConversionError naming the field, a config it cannot write —
whatever the config's kinds: `attnlab convert --model-type FAMILY` hands it any model, and
`interop/export_family.py` tries each family in turn. An attention without q/k/v biases (MLA,
Transformer-XL's) ended in an AttributeError in six converters (issue 49)."""

from __future__ import annotations

import pytest

import attnlab as al
from attnlab.interop.converter import CONVERTERS, ConversionError

PRESETS = al.presets.names()


@pytest.mark.parametrize("model_type", CONVERTERS.names())
def test_a_converter_writes_or_refuses_every_preset(model_type):
    conv = CONVERTERS.get(model_type)
    written = 0
    for name in PRESETS:
        cfg = al.presets.tiny(al.presets.get(name))
        try:
            hf = conv.config_to_hf(cfg)
        except ConversionError as err:
            assert str(err).strip(), name  # names what does not fit
            continue
        written += 1
        assert isinstance(hf, dict) and hf, name
    assert written < len(PRESETS)  # some preset of another family is refused (the sweep ran)
