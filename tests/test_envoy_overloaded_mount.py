"""Envoys of modules whose submodules are named like nnsight attributes (BERT's ``output``).

Runs against whatever nnsight this interpreter imports. Tests marked
``fixed_by_series`` assert behaviour our patch series brings to nnsight 0.7.0;
the negative control (``test_negative_control.py``) requires exactly those to
fail on the release. nnsight 0.8 reaches the same behaviour its own way, and
what differs between the lines comes from ``nnsight_repro.lines``.
"""

import gc
import io
import json
import sys
import threading
import types
import weakref

import pytest
import transformers
from nnsight import NNsight
from nnsight.intervention import envoy as envoy_module
from nnsight.intervention.envoy import Envoy

from nnsight_repro import checks, models
from nnsight_repro.wire import live_envoy_classes

fixed = pytest.mark.fixed_by_series

# Encoders need the series; the decoder is the control that passes everywhere.
PANEL = [pytest.param(name, marks=[fixed] if entry.encoder else [], id=name)
         for name, entry in models.PANEL.items()]


def synthesized(tree):
    """Distinct envoy classes nnsight made up for ``tree`` (0.7.0 names them all alike, so count objects)."""
    return {type(e) for e in tree.modules() if "Preserved" in type(e).__name__}


# The synthesized class -------------------------------------------------------

@fixed
@pytest.mark.parametrize("layers", [2, 12, 48])
def test_bert_of_any_depth_gets_at_most_one_synthesized_class(bert, line, layers):
    tree = NNsight(bert(layers))
    assert len(synthesized(tree)) == (1 if line.synthesizes_classes else 0)


def test_each_layer_keeps_its_own_colliding_child(bert, line):
    layer = NNsight(bert()).bert.encoder.layer
    children = [getattr(layer[i], line.child_attr()) for i in range(2)]
    assert [c.path for c in children] == [f"model.bert.encoder.layer.{i}.output" for i in range(2)]
    assert children[0]._module is bert().bert.encoder.layer[0].output


def test_decoder_tree_synthesizes_no_class(subject):
    assert synthesized(subject("gpt2").model) == set()


@fixed
def test_synthesized_class_holds_only_builtin_properties_over_plain_functions(bert, line):
    """What a server rebuilds from a request: a decorated function would be rebuilt from its decorator's text."""
    classes = synthesized(NNsight(bert()))
    assert len(classes) == (1 if line.synthesizes_classes else 0)
    for cls in classes:
        attributes = {name: value for name, value in vars(cls).items() if not name.startswith("__")}
        assert set(attributes) == {"output", "nns_output"}
        for prop in attributes.values():
            assert type(prop) is property
            for function in (prop.fget, prop.fset):
                assert not hasattr(function, "__wrapped__")
                assert all(isinstance(c.cell_contents, (str, type)) for c in function.__closure__ or ())


def test_synthesized_classes_keep_no_envoy_base_alive(bert):
    class ShortLivedEnvoy(Envoy):
        """A base only this test wraps with."""

    tree = NNsight(bert(), envoys=ShortLivedEnvoy)
    base = weakref.ref(ShortLivedEnvoy)
    del tree, ShortLivedEnvoy
    gc.collect()
    assert base() is None


class ThreadedEnvoy(Envoy):
    """A base no other test wraps with, so its classes are made inside the threads."""


@fixed
def test_concurrent_wrapping_shares_one_class_per_base_and_name(bert, line):
    model, start, trees = bert(), threading.Barrier(8), []

    def wrap():
        start.wait()
        trees.append(NNsight(model, envoys=ThreadedEnvoy))

    threads = [threading.Thread(target=wrap) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    made = set().union(*map(synthesized, trees))
    assert len(trees) == 8
    assert len(made) == (1 if line.synthesizes_classes else 0)
    assert all(issubclass(cls, ThreadedEnvoy) for cls in made)


@fixed
def test_tree_whose_envoy_base_travels_by_value_round_trips(bert):
    """A base in a notebook or script is pickled by value, and so is its synthesized class."""
    import cloudpickle
    from nnsight.intervention import serialization

    module = types.ModuleType("nnsight_repro_by_value_envoys")
    sys.modules[module.__name__] = module
    try:
        module.Envoy = Envoy
        exec("class NotebookEnvoy(Envoy):\n    pass", module.__dict__)
        cloudpickle.register_pickle_by_value(module)
        tree = NNsight(bert(), envoys=module.NotebookEnvoy)
        persistent = {"Interleaver": tree.interleaver, **{f"Module:{e.path}": e._module for e in tree.modules()}}
        payload = serialization.dumps(tree)
    finally:
        if module.__name__ in cloudpickle.list_registry_pickle_by_value():
            cloudpickle.unregister_pickle_by_value(module)
        sys.modules.pop(module.__name__, None)
    # The module is gone: only the bytes can bring the class back.
    loaded = serialization.loads(payload, persistent)
    assert [e.path for e in loaded.modules()] == [e.path for e in tree.modules()]


def global_pickle(module: str, name: str) -> bytes:
    """A protocol-4 pickle that only looks ``module.name`` up (dotted names are walked attribute by attribute)."""
    def string(text):
        return b"\x8c" + bytes([len(text)]) + text.encode()

    return b"\x80\x04" + string(module) + string(name) + b"\x93."


@pytest.fixture(scope="module")
def frozen_heap():
    """Everything alive so far moved out of the collector's reach (``gc.freeze``), so each count of live
    classes collects only what the test itself made: exact, and a fraction of a full collection."""
    import gc

    gc.collect()
    gc.freeze()
    yield
    gc.unfreeze()


@pytest.mark.parametrize("name", [
    "Envoy__Preserved_output",                    # the wire name an earlier version of our series used
    "Envoy__Preserved_input__Preserved_output",
    "Envoy.Preserved",                            # what the synthesized class calls itself
    "Envoy.nns_output",
    "NotAnything",
])
def test_a_request_naming_what_nnsight_does_not_define_fails_plainly_and_creates_nothing(name, frozen_heap):
    from nnsight.intervention import serialization

    names_before, classes_before = set(vars(envoy_module)), live_envoy_classes()
    with pytest.raises(AttributeError):
        serialization.CustomCloudUnpickler(io.BytesIO(global_pickle(envoy_module.__name__, name)), {}).load()
    assert set(vars(envoy_module)) == names_before
    assert live_envoy_classes() == classes_before


# Through nnsight's serializer and the remote simulation ----------------------

@pytest.mark.parametrize("name", PANEL)
def test_tree_round_trips_through_nnsights_serializer(subject, name):
    result = checks.check_serializer_round_trip(subject(name))
    assert result["ok"], result


@pytest.mark.parametrize("name", PANEL)
def test_remote_local_trace_equals_local_trace(subject, name):
    result = checks.check_remote_local(subject(name))
    assert result["ok"], result


def test_assigning_a_colliding_layers_output_replaces_what_the_next_layer_gets(bert, line):
    import torch

    tree = NNsight(bert())
    layers = tree.bert.encoder.layer
    with torch.no_grad(), tree.trace(torch.tensor([[5, 6, 7]])):
        setattr(layers[0], line.output_attr(layers[0]), torch.zeros(1, 3, 32))
        after = layers[1].input.save()
    assert after.abs().sum() == 0


def test_colliding_layer_output_is_readable_in_a_local_trace(subject):
    s = subject("bert-mlm")
    saved = s.trace(s.ids[0])
    assert list(saved["first_layer"].shape) == [1, s.ids[0].shape[1], 32]


# The remote model key ---------------------------------------------------------

@pytest.mark.parametrize("name", PANEL)
def test_server_rebuilds_the_wrapped_class_from_the_key(subject, name):
    result = checks.check_remote_key(subject(name))
    assert result["ok"], result


@fixed
def test_masked_lm_key_names_its_class(subject, line):
    s = subject("bert-mlm")
    fields = json.loads(s.model.to_model_key().partition(":")[2])
    expected = s.entry.automodel if line.class_field == "automodel" else s.entry.task
    assert fields[line.class_field] == expected


RELEASED_DEFAULT_KEYS = {
    "automodel": 'nnsight.modeling.language.LanguageModel:{"repo_id": "nnsight-repro/gpt2", "revision": null}',
    "task": 'nnsight.modeling.transformers.TransformersModel:'
            '{"repo_id": "nnsight-repro/gpt2", "revision": null, "task": "text-generation"}',
}


def test_default_class_key_is_byte_identical_to_the_release(subject, line):
    assert subject("gpt2").model.to_model_key() == RELEASED_DEFAULT_KEYS[line.class_field]


def _wrap_with_selector(line, selector: str, **kwargs):
    """Wrap the tiny BERT naming its class by ``selector`` (0.7: automodel name, 0.8: task)."""
    path = str(models.saved_model("bert-mlm"))
    if line.class_field == "automodel":
        from nnsight import LanguageModel

        return LanguageModel(path, automodel=selector, **kwargs)
    from nnsight.modeling.transformers import TransformersModel

    return TransformersModel(path, task=selector, **kwargs)


@fixed
def test_unknown_class_selector_is_refused_naming_it(line):
    selector = {"automodel": "AutoModelForBogus", "task": "bogus-task"}[line.class_field]
    # Not AttributeError: a failed getattr deep inside does not tell the user what to fix.
    with pytest.raises((ValueError, KeyError), match=selector):
        _wrap_with_selector(line, selector)


@fixed
def test_key_never_names_a_class_a_server_cannot_rebuild(subject, line):
    s = subject("bert-mlm")
    if line.class_field == "task":
        # 0.8 sends only the task, whatever class the user loaded with.
        model = _wrap_with_selector(line, s.entry.task, tokenizer=s.tokenizer, automodel=transformers.BertForMaskedLM)
        fields = json.loads(model.to_model_key().partition(":")[2])
        assert fields.get("task") == s.entry.task and "automodel" not in fields
        return
    from nnsight import LanguageModel

    class ProjectAutoModel(transformers.AutoModelForMaskedLM):
        """Loads like an Auto class, but no server can find it by name."""

    model = LanguageModel(str(s.path), automodel=ProjectAutoModel, tokenizer=s.tokenizer)
    with pytest.raises(ValueError, match="Auto class"):
        model.to_model_key()
