"""``speechbrain-fl budgets --preset``: a real preset's groups at full size, as Table I groups."""

import json
import re

import pytest
import torch

from speechbrain_fl.cli import main
from speechbrain_fl.privacy.layout import layout_from_model


def _run(capsys, *args):
    assert main(["budgets", *args, "--method", "pfl_uniform", "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def _counts(result):
    counts = {}
    for group in result["groups"]:
        counts[group["component"]] = counts.get(group["component"], 0) + 1
    return counts


def test_whisper_tinyllama_has_table_is_110_groups_and_282_tensors(capsys):
    """Table I: L = 110 = 64 encoder + 44 LLM + 2 connector, encoder groups of 30,720 values
    (the A, or B, factors of q, k and v: 3 x 8 x 1,280); per tensor: 192 + 88 + 2 = 282."""
    paper = _run(capsys, "--preset", "whisper_tinyllama")
    assert paper["group_by"] == "layer_factor" and len(paper["groups"]) == 110
    assert _counts(paper) == {"encoder": 64, "llm": 44, "connector": 2}
    encoder = [g["numel"] for g in paper["groups"] if g["component"] == "encoder"]
    assert set(encoder) == {30720} and sum(encoder) == 1_966_080
    budgets = {round(g["budget"], 12) for g in paper["groups"]}
    assert budgets == {round(110**-0.5, 12)}  # PFL-Uniform: C / sqrt(L)
    tensors = _run(capsys, "--preset", "whisper_tinyllama", "--group-by", "parameter")
    assert _counts(tensors) == {"encoder": 192, "llm": 88, "connector": 2}
    frozen = _run(capsys, "--preset", "whisper_tinyllama", "--freeze-encoder")
    assert _counts(frozen) == {"llm": 44, "connector": 2}


@pytest.mark.parametrize(
    ("args", "match"),
    [
        (["--preset", "tiny"], "is not a real \\(hub\\) preset"),
        (["--layout", "x.json", "--group-by", "module"], "apply to --preset only"),
        (["--layout", "x.json", "--preset", "voxtral"], "not allowed with argument"),
    ],
)
def test_bad_arguments_are_usage_errors(capsys, args, match):
    with pytest.raises(SystemExit) as err:
        main(["budgets", *args, "--method", "flat"])
    assert err.value.code == 2
    assert re.search(match, capsys.readouterr().err)


def test_layer_factor_groups_a_layers_lora_factors_and_keeps_other_tensors_apart():
    from peft import LoraConfig, get_peft_model

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.q, self.v = torch.nn.Linear(4, 4), torch.nn.Linear(4, 2)

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = torch.nn.ModuleList([Block(), Block()])
            self.proj = torch.nn.Linear(3, 3)

    net = get_peft_model(Net(), LoraConfig(r=2, target_modules=["q", "v"]))
    net.base_model.model.proj.requires_grad_(True)
    lay = layout_from_model(net, components={"m": ["*"]}, group_by="layer_factor")
    sizes = {g.name.split("model.", 2)[-1]: g.numel for g in lay}
    # A: r x d_in of q and v (2 x 4 + 2 x 4); B: d_out x r (4 x 2 + 2 x 2); proj: 9 and 3
    assert sizes == {
        "layers.0.lora_A": 16, "layers.0.lora_B": 12, "layers.1.lora_A": 16,
        "layers.1.lora_B": 12, "proj.weight": 9, "proj.bias": 3,
    }  # fmt: skip
