"""partial/metadata.py on its own: how each form of a model's declarations is read
(classes, class names, recorder objects with layer names), what is ignored, and the
search for the shallowest declared module."""

import logging
from types import SimpleNamespace

from torch import nn

from cudagraphs.partial.metadata import _spec, first_declared, read_metadata
from cudagraphs.partial.vocabulary import ClassSpec


class Attn(nn.Module):
    pass


class Router(nn.Module):
    pass


def test_each_form_of_a_declaration():
    assert _spec(Attn) == ClassSpec(Attn)
    assert _spec("Attn") == ClassSpec(None, name_hint="Attn")
    assert _spec("") is None
    assert _spec(None) is None
    rec = SimpleNamespace(target_class=Attn, layer_name=".attn.", class_name=None)
    assert _spec(rec) == ClassSpec(Attn, "attn")
    # A target that is not a class and an empty or non-str class name are dropped.
    assert _spec(SimpleNamespace(target_class="Attn", class_name="Attn")) == ClassSpec(
        None, name_hint="Attn"
    )
    assert _spec(SimpleNamespace(target_class=Attn, class_name="")).name_hint is None
    assert _spec(SimpleNamespace(target_class=Attn, class_name=5)).name_hint is None
    assert _spec(SimpleNamespace(target_class="Attn", class_name=5)) is None
    # Only dots are stripped from a layer name.
    assert _spec(SimpleNamespace(target_class=Attn, layer_name="Xattn.")).layer_name == "Xattn"


def test_labels_name_the_class_or_the_hint():
    assert ClassSpec(Attn).label() == "Attn"
    assert ClassSpec(None, name_hint="self_attn").label() == "'self_attn'"
    assert ClassSpec(Attn, "attn").label() == "Attn at .attn"


def test_a_model_without_recorded_outputs_still_declares_its_layers():
    class Model(nn.Module):
        _no_split_modules = ["Block"]

    meta = read_metadata(Model())
    assert meta.layer_classes == ("Block",)
    assert meta.attention == meta.router == meta.cross_attention == ()


def test_routers_are_matched_by_class_and_layer_name():
    class Model(nn.Module):
        _no_split_modules = ["Block"]
        _can_record_outputs = {
            "router_logits": SimpleNamespace(target_class=Router, layer_name="mlp")
        }

    meta = read_metadata(Model())
    assert meta.is_router("layers.0.mlp.gate", Router())
    assert not meta.is_router("layers.0.attn.gate", Router())
    assert not meta.is_router("layers.0.mlp.gate", Attn())


def test_first_declared_takes_the_shallowest_and_says_when_there_are_several(caplog):
    block = nn.Module()
    block.a = Attn()
    block.inner = nn.Module()
    block.inner.deep = Attn()

    def is_attn(name, module):
        return isinstance(module, Attn)

    with caplog.at_level(logging.DEBUG, logger="cudagraphs.partial.metadata"):
        name, module, parent_name, parent = first_declared(block, "b", is_attn, "attention")
        assert (name, parent_name) == ("b.a", "b") and module is block.a and parent is block
        assert caplog.records == [], "one at the shallowest depth: nothing to say"
        block.b = Attn()
        assert first_declared(block, "b", is_attn, "attention")[0] == "b.a"
    (said,) = caplog.records
    assert "several attention modules" in said.getMessage()
    assert first_declared(nn.Module(), "", is_attn, "attention") is None
