"""Layouts: from a model (parameter/module grouping, component patterns) and from JSON."""

import json

import pytest
import torch

from speechbrain_fl.privacy import Group, Layout, layout_from_model


class LoraLinear(torch.nn.Module):
    """A PEFT-shaped LoRA layer: frozen base, lora_A.default and lora_B.default."""

    def __init__(self, d_in, d_out, r=2):
        super().__init__()
        self.base_layer = torch.nn.Linear(d_in, d_out)
        self.base_layer.requires_grad_(False)
        self.lora_A = torch.nn.ModuleDict({"default": torch.nn.Linear(d_in, r, bias=False)})
        self.lora_B = torch.nn.ModuleDict({"default": torch.nn.Linear(r, d_out, bias=False)})


class SpeechLLM(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.encoder = torch.nn.ModuleDict({"q_proj": LoraLinear(8, 8), "v_proj": LoraLinear(8, 8)})
        self.connector = torch.nn.Linear(8, 6)
        self.llm = torch.nn.ModuleDict({"q_proj": LoraLinear(6, 6)})


COMPONENTS = {"encoder": ["encoder.*"], "connector": ["connector.*"], "llm": ["llm.*"]}


def test_parameter_grouping():
    lay = layout_from_model(SpeechLLM(), components=COMPONENTS)
    assert lay.names == (
        "encoder.q_proj.lora_A.default.weight",
        "encoder.q_proj.lora_B.default.weight",
        "encoder.v_proj.lora_A.default.weight",
        "encoder.v_proj.lora_B.default.weight",
        "connector.weight",
        "connector.bias",
        "llm.q_proj.lora_A.default.weight",
        "llm.q_proj.lora_B.default.weight",
    )
    assert lay.components == ("encoder", "connector", "llm")
    assert [g.numel for g in lay][:2] == [16, 16]
    assert lay.total_numel == 4 * 16 + 48 + 6 + 2 * 12


def test_module_grouping_pairs_lora_a_and_b():
    lay = layout_from_model(SpeechLLM(), components=COMPONENTS, group_by="module")
    assert lay.names == ("encoder.q_proj", "encoder.v_proj", "connector", "llm.q_proj")
    assert lay.members_of("encoder.q_proj") == (
        "encoder.q_proj.lora_A.default.weight",
        "encoder.q_proj.lora_B.default.weight",
    )
    assert lay.group("connector").numel == 54
    named = dict(SpeechLLM().named_parameters())
    named = {k: v for k, v in named.items() if "base_layer" not in k}
    assert [t.numel() for t in lay.group_tensors(named)["connector"]] == [48, 6]


def test_first_matching_label_wins_and_default():
    comps = {"special": ["encoder.q_proj.*"], "encoder": ["encoder.*"]}
    lay = layout_from_model(SpeechLLM(), components=comps, default_component="rest")
    assert lay.group("encoder.q_proj.lora_A.default.weight").component == "special"
    assert lay.group("encoder.v_proj.lora_A.default.weight").component == "encoder"
    assert lay.group("connector.bias").component == "rest"


def test_unmatched_and_mixed_errors():
    with pytest.raises(ValueError, match="'connector.weight' matches no component"):
        layout_from_model(SpeechLLM(), components={"encoder": ["encoder.*"], "llm": ["llm.*"]})
    with pytest.raises(ValueError, match="module 'connector' mixes components"):
        layout_from_model(
            SpeechLLM(),
            components={"a": ["connector.weight"], "b": ["*"]},
            group_by="module",
        )
    with pytest.raises(ValueError, match="group_by"):
        layout_from_model(SpeechLLM(), components=COMPONENTS, group_by="layerwise")
    frozen = torch.nn.Linear(2, 2).requires_grad_(False)
    with pytest.raises(ValueError, match="no trainable"):
        layout_from_model(frozen, components=COMPONENTS)


def test_json_round_trip(tmp_path):
    lay = layout_from_model(SpeechLLM(), components=COMPONENTS, group_by="module")
    path = tmp_path / "layout.json"
    lay.to_json(path)
    rows = json.loads(path.read_text())
    assert rows[2] == {
        "name": "connector",
        "component": "connector",
        "numel": 54,
        "members": ["connector.weight", "connector.bias"],
    }
    assert Layout.from_json(path) == lay
    assert Layout.from_list(lay.to_list()) == lay


def test_json_errors_name_the_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.json"):
        Layout.from_json(tmp_path / "nope.json")
    bad = tmp_path / "bad.json"
    bad.write_text("[{")
    with pytest.raises(ValueError, match="bad.json is not valid JSON"):
        Layout.from_json(bad)
    zero = tmp_path / "zero.json"
    zero.write_text(json.dumps([{"name": "w", "component": "llm", "numel": 0}]))
    with pytest.raises(ValueError, match=r"zero.json: entry 0: group 'w'.*positive"):
        Layout.from_json(zero)
    empty = tmp_path / "empty.json"
    empty.write_text("[]")
    with pytest.raises(ValueError, match="empty.json.*empty"):
        Layout.from_json(empty)
    nokey = tmp_path / "nokey.json"
    nokey.write_text(json.dumps([{"name": "w", "numel": 3}]))
    with pytest.raises(ValueError, match=r"entry 0 lacks key\(s\) \['component'\]"):
        Layout.from_json(nokey)


def test_duplicates_rejected():
    with pytest.raises(ValueError, match="duplicate group name 'a'"):
        Layout([Group("a", "llm", 1), Group("a", "llm", 2)])
    with pytest.raises(ValueError, match="parameter 'p' is in two groups"):
        Layout([Group("a", "llm", 1, ("p",)), Group("b", "llm", 1, ("p",))])
