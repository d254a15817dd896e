"""Multimodal checkpoints trained on text, and mRoPE text positions.

4 gloo ranks, the heterogeneous family plan, fp64: Gemma 3's and Qwen2.5-VL's ``*ForConditionalGeneration``
(vision tower frozen), Qwen3-VL's (mRoPE, 4-row positions) and Llama 4's text model (chunked attention) take
one SGD step equal to the native composite model's on text. One process: the vision tower is left as it was and named, image placeholders and 3-D positions are refused
in one line."""
import warnings

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from hf.family_runs import assert_exact, family_results  # noqa: E402

from flexsp.hf import UnsupportedModelError, prepare_model  # noqa: E402
from flexsp.hf.families import LENGTHS, batch, tiny_model  # noqa: E402
from flexsp.runtime import AttentionContext, pack  # noqa: E402

FAMILIES = ("gemma3", "qwen2_5_vl", "qwen3_vl", "llama4")


@pytest.fixture(scope="module")
def results():
    return family_results(FAMILIES)


@pytest.mark.parametrize("model_type", FAMILIES)
def test_language_model_of_a_composite_trains_exactly(results, model_type):
    assert_exact(results, model_type)


def _prepared(model_type):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        sp = prepare_model(tiny_model(model_type), max_seqlen=max(LENGTHS))
    return sp, [str(w.message) for w in caught]


def test_vision_tower_left_untouched_and_named():
    sp, messages = _prepared("gemma3")
    assert sp.frozen == ("model.multi_modal_projector", "model.vision_tower")
    assert any("model.vision_tower" in m and "left untouched" in m for m in messages)
    tower = [p for n, p in sp.model.named_parameters() if n.startswith("model.vision_tower")]
    assert tower and not any(p.requires_grad for p in tower)
    assert all(p.requires_grad for p in sp.model.get_decoder().parameters())
    assert all(type(u).__name__ == "Gemma3DecoderLayer" for u in sp.fsdp_units())   # no vision block


def test_image_placeholders_and_3d_positions_refused():
    sp, _ = _prepared("qwen2_5_vl")
    image = int(sp.model.config.image_token_id)
    seqs = batch()[:2]
    seqs[1] = seqs[1].clone()
    seqs[1][3] = image
    p = pack(seqs, 1)
    ctx = AttentionContext.packed(p.cu_seqlens)
    with pytest.raises(UnsupportedModelError, match=f"placeholder token {image}; FlexSP trains the language model on "
                                                    f"text only"):
        sp(p.input_ids, p.position_ids, ctx)
    p = pack(batch()[:2], 1)
    with pytest.raises(UnsupportedModelError, match=r"3-D rotary positions, mRoPE"):
        sp(p.input_ids, p.position_ids[None].expand(3, -1), ctx)


def test_mrope_text_positions_are_the_models_own():
    """A packed Qwen2.5-VL text row under FlexSP (1-D positions, which the text model lifts to equal 3-D
    rows) gives the composite model's own logits, each sequence run alone through its forward."""
    sp, _ = _prepared("qwen2_5_vl")
    seqs = batch()[:3]
    p = pack(seqs, 1)
    with torch.no_grad():
        ours = sp(p.input_ids, p.position_ids, AttentionContext.packed(p.cu_seqlens))
        native = torch.cat([sp.model(input_ids=s[None]).logits[0] for s in seqs])
    assert float((ours - native).abs().max() / native.abs().max()) < 1e-12


def test_llama4_multimodal_class_trains_its_text_model():
    """``Llama4ForConditionalGeneration`` (what Llama 4 checkpoints load as): its ``get_decoder()`` is its text
    LM, head and all; FlexSP follows it down to the decoder (it failed with an AttributeError read as a
    refusal), and the packed loss on text equals the native model's per sequence."""
    import copy

    from transformers import AutoModelForImageTextToText

    from flexsp.hf.families import tiny_config
    torch.manual_seed(0)
    model = AutoModelForImageTextToText.from_config(tiny_config("llama4"), attn_implementation="sdpa").double()
    native = copy.deepcopy(model)
    sp = prepare_model(model, max_seqlen=max(LENGTHS))
    sequences = batch()[:4]
    shard = pack(sequences, degree=1)
    got = sp(shard.input_ids, shard.position_ids, AttentionContext.packed(shard.cu_seqlens), labels=shard.labels)
    with torch.no_grad():
        want = sum(float(native(input_ids=s[None], labels=s[None]).loss) * (len(s) - 1) for s in sequences)
    assert float(got) == pytest.approx(want, rel=1e-6)   # HF casts its logits to fp32 for the loss


def test_placeholder_tokens_are_found_by_name_in_any_composite_config():
    """A composite config's modality tokens under names beyond the usual few (Molmo2's ``image_patch_id`` and
    image/frame start and end tokens) are refused in input_ids too: text-only training must not meet them."""
    from types import SimpleNamespace

    from flexsp.hf.adapter import placeholder_ids
    text = SimpleNamespace()
    cfg = SimpleNamespace(image_patch_id=7, image_start_token_id=5, frame_end_token_id=9, low_res_image_start_token_id=4,
                          eos_token_id=2, use_frame_special_tokens=True, get_text_config=lambda: text)
    model = SimpleNamespace(config=cfg)
    assert placeholder_ids(model).tolist() == [4, 5, 7, 9]


def _native_and_ours(model, lengths):
    """The summed next-token loss of ``lengths``-token sequences: FlexSP's on one packed row, the model's own per
    sequence."""
    model = model.double()
    sp = prepare_model(model, max_seqlen=max(lengths))
    gen = torch.Generator().manual_seed(1)
    seqs = [torch.randint(1, 100, (n,), generator=gen) for n in lengths]
    p = pack(seqs, 1)
    ours = float(sp(p.input_ids, p.position_ids, AttentionContext.packed(p.cu_seqlens), labels=p.labels))
    with torch.no_grad():
        native = sum(float(model(input_ids=s[None], labels=s[None], use_cache=False).loss) * (len(s) - 1) for s in seqs)
    return ours, native


def test_a_window_the_models_code_never_applies_is_not_applied():
    """A Qwen3-VL-MoE ``text_config`` carrying ``sliding_window`` (its modeling code never uses it) was trained with
    that window on every layer: accepted (the probe's sequences are shorter than any window) and a different loss
    for every longer sequence."""
    from flexsp.hf.families import tiny_config
    from transformers import AutoModelForImageTextToText
    config = tiny_config("qwen3_vl_moe")
    config.text_config.sliding_window = 8       # as a config.json's text_config loads it
    torch.manual_seed(0)
    model = AutoModelForImageTextToText.from_config(config, attn_implementation="sdpa", experts_implementation="eager")
    ours, native = _native_and_ours(model, (20, 13))
    assert ours == pytest.approx(native, rel=1e-6)


def test_a_logit_scale_the_composite_never_applies_is_not_applied():
    """Aya Vision's text config carries Cohere2's ``logit_scale``, which its composite class never applies: FlexSP
    scaled its logits by it, and the probe refused a supported model as one that 'mixes tokens'."""
    ours, native = _native_and_ours(tiny_model("aya_vision"), (9, 5))
    assert ours == pytest.approx(native, rel=1e-6)


def test_a_window_the_model_only_stores_is_not_applied():
    """Moshi's config carries ``sliding_window`` (3,000 by default) and its decoder layer stores it, but the model
    never applies it: FlexSP windowed every layer (the probe's short sequences never reached the window)."""
    from flexsp.hf.features import layer_features
    model = tiny_model("moshi", sliding_window=4)
    assert {f.window for f in layer_features(model).values()} == {None}
    ours, native = _native_and_ours(model, (9, 13))
    assert ours == pytest.approx(native, rel=1e-6)


def test_a_user_subclass_keeps_the_logit_scale_its_base_class_applies(tmp_path, monkeypatch):
    """The code that names an attribute may be a base class's: a subclass in a user's own file (which never
    names ``logit_scale``) inherits Cohere's forward, which scales the logits."""
    from flexsp.hf.families import tiny_config
    from flexsp.hf.features import logit_transform
    (tmp_path / "user_models.py").write_text("from transformers import CohereForCausalLM\n\n\n"
                                             "class MyCohere(CohereForCausalLM):\n    pass\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    from user_models import MyCohere
    config = tiny_config("cohere")
    assert logit_transform(MyCohere(config)) == (config.logit_scale, None)
