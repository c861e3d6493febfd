"""`attnlab presets` (issue 49, item 11: it took 20 s, most of it building DeepSeek-V3's and the
other mixtures' experts on the meta device one by one): the listing builds each mixture with its
fewest experts and counts the rest by hand (src/attnlab/cli/inspect.py, count_parameters); the
counts stay the full build's (build.count_parameters) and transformers' (tests/test_presets.py).
"""

from __future__ import annotations

import functools

import pytest

import attnlab as al
from attnlab.build import count_parameters as built_count
from attnlab.cli import main
from attnlab.cli.inspect import count_parameters
from attnlab.config import MoEFFN
from attnlab.nn.ffn import moe

MOE = [n for n in al.presets.names() if isinstance(al.presets.get(n).ffn, MoEFFN)]


def test_every_mixture_preset_is_listed():
    assert {"mixtral-8x7b", "deepseek-v2-lite", "deepseek-v3", "gpt-oss-20b"} <= set(MOE)


@pytest.mark.parametrize("name", MOE)
def test_the_count_by_hand_equals_the_built_model_at_test_size(name):
    """At test size (more experts than the fewest the routing allows) the sum equals the model
    built with every expert: router rows, expert biases (GPT-OSS), dense first blocks (V3)."""
    for cfg in (al.presets.tiny(al.presets.get(name)), al.presets.tiny(al.presets.get(name), 96)):
        f = cfg.ffn
        more = cfg.merged(ffn={"n_experts": 4 * f.n_experts})  # 4x: still a multiple of groups
        for c in (cfg, more):
            assert count_parameters(c) == built_count(c), name


@pytest.mark.slow
@pytest.mark.parametrize("name", MOE)
def test_the_count_by_hand_equals_the_built_model_at_full_size(name):
    cfg = al.presets.get(name)
    assert count_parameters(cfg) == built_count(cfg)


def test_presets_lists_without_building_every_expert(capsys, monkeypatch):
    """The listing's counts are the references' (Mixtral: arXiv:2401.04088 and transformers,
    DeepSeek-V2-Lite: transformers, tests/test_presets.py), yet no mixture is built with more
    than 16 routed experts (DeepSeek-V3's fewest: 8 groups of 2, top2-sum scores): before, all
    of DeepSeek-V3's 256 in each of 58 blocks were built."""
    built = []
    init = moe.MoEFFN.__init__

    @functools.wraps(init)  # its signature: the registry passes what it names
    def record(self, *args, **kwargs):
        built.append(kwargs["n_experts"])
        init(self, *args, **kwargs)

    monkeypatch.setattr(moe.MoEFFN, "__init__", record)
    assert main(["presets"]) == 0
    rows = {line.split()[0]: line.split()[1] for line in capsys.readouterr().out.splitlines()[1:]}
    assert rows["mixtral-8x7b"] == "46,702,792,704"  # tests/cli/test_inspect.py's, by hand
    assert rows["deepseek-v2-lite"] == "15,706,484,224"  # tests/test_presets.py: transformers'
    assert set(rows) == set(al.presets.names())
    assert built and max(built) <= 16
