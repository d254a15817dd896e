"""A model directory given to ``--hf-config`` (replay, profile, selftest) is untrusted input: its code never
runs, whatever is wrong with its ``config.json`` is one line, and a config whose model outgrows the machine
is refused before anything is allocated."""
import json

import pytest

pytest.importorskip("transformers")

from flexsp.hf.features import UnsupportedModelError
from flexsp.hf.prepare import from_config, hf_config_kwargs, load_config
from flexsp.plan.specs import get_model


def config_dir(tmp_path, content, name="model"):
    folder = tmp_path / name
    folder.mkdir()
    (folder / "config.json").write_text(content if isinstance(content, str) else json.dumps(content))
    return folder


def llama(**overrides):
    return {"model_type": "llama", **hf_config_kwargs(get_model("hf-llama")), **overrides}


def test_custom_model_code_never_runs_even_when_asked(tmp_path, monkeypatch):
    """transformers asks on stdin whether to run a directory's code and runs it on "y"; FlexSP refuses first."""
    marker = tmp_path / "ran"
    folder = config_dir(tmp_path, {"model_type": "evil", "architectures": ["EvilModel"],
                                   "auto_map": {"AutoConfig": "evil.EvilConfig", "AutoModelForCausalLM": "evil.EvilModel"}})
    (folder / "evil.py").write_text(f"open({str(marker)!r}, 'w').write('x')\n")
    monkeypatch.setattr("builtins.input", lambda *a, **k: "y")
    with pytest.raises(UnsupportedModelError, match="names custom model code .auto_map.; FlexSP never runs code"):
        load_config(folder)
    assert not marker.exists()


@pytest.mark.parametrize("content, message", [
    ('{"model_type": "llama",', "is not valid JSON"),
    ("[1, 2]", "must be a JSON object, got list"),
    ({"model_type": "nosuchtype"}, "cannot read model config .*nosuchtype"),
    # pydantic puts the reason on the line after "Validation error for field 'hidden_size':"
    ({"model_type": "llama", "hidden_size": "64"}, "field 'hidden_size': .*expected int, got str"),
])
def test_a_bad_config_is_one_line(tmp_path, content, message):
    with pytest.raises(UnsupportedModelError, match=message) as caught:
        load_config(config_dir(tmp_path, content))
    assert "\n" not in str(caught.value)


def test_a_model_larger_than_the_machine_is_refused_before_it_is_built(tmp_path):
    folder = config_dir(tmp_path, llama(vocab_size=10**9, hidden_size=65536, intermediate_size=65536 * 4))
    with pytest.raises(UnsupportedModelError, match=r"parameters \(.* GiB\), more than this machine's .* GiB of memory"):
        from_config(folder, probe=False)


def test_a_config_that_cannot_build_is_one_line(tmp_path):
    with pytest.raises(UnsupportedModelError, match="cannot build a model from .*negative dimension"):
        from_config(config_dir(tmp_path, llama(hidden_size=-64)), probe=False)


def test_a_good_directory_still_loads(tmp_path):
    model = from_config(config_dir(tmp_path, llama()), probe=False)
    assert sum(p.numel() for p in model.parameters()) > 0


def test_with_layers_cuts_every_per_layer_list():
    """The profile builds a model of a few layers of a config; its MLP kinds (``mlp_layer_types``, which
    transformers checks against the layer count), Llama 4's ``no_rope_layers`` and MoE layer indices kept the full
    model's, so such a model could not be built, or built with the wrong layers."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from flexsp.hf.prepare import with_layers
    laguna = AutoConfig.for_model("laguna", num_hidden_layers=4, mlp_layer_types=["dense", "sparse", "dense", "sparse"])
    cut = with_layers(laguna, 2)
    assert cut.mlp_layer_types == ["dense", "sparse"] and laguna.mlp_layer_types[3] == "sparse"   # a copy
    with torch.device("meta"):
        AutoModelForCausalLM.from_config(cut)
    llama4 = AutoConfig.for_model("llama4_text", num_hidden_layers=4, no_rope_layers=[1, 1, 0, 1], moe_layers=[1, 3])
    cut = with_layers(llama4, 2)
    assert (cut.no_rope_layers, cut.moe_layers) == ([1, 1], [1])
    qwen = with_layers(AutoConfig.for_model("qwen3_moe", num_hidden_layers=4, mlp_only_layers=[0, 3]), 2)
    assert qwen.mlp_only_layers == [0]
