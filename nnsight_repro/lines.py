"""Everything that differs between the nnsight lines we support, in one table.

0.7 (the release most NDIF users run, and our patch series' base) and 0.8
(upstream's rewrite) solve the same collision differently:

=====================  ==========================  ==========================
                       0.7 (+ our series)          0.8
=====================  ==========================  ==========================
colliding child        ``layer.output``            ``layer.E_output``
nnsight's output       ``layer.nns_output``        ``layer.output``
synthesized class      one, unbound (by value)     none
wrapper                ``LanguageModel``           ``TransformersModel``
model class in key     ``"automodel"``             ``"task"``
hub-id cache           ``ID_CACHE``                ``_ID_CACHE``
remote status update   ``handle_response``         ``note``
=====================  ==========================  ==========================

Nothing else in the project branches on an nnsight version.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Line:
    name: str
    #: Prefix of nnsight's attribute when a submodule took its name (0.7), or
    #: of the submodule's envoy when nnsight keeps the name (0.8).
    moved_prefix: str
    #: True when nnsight keeps ``.output`` and the submodule moves.
    nnsight_keeps_name: bool
    wrapper: str
    #: Key field that tells a server which model class to rebuild.
    class_field: str
    id_cache: str
    #: Whether envoys with a colliding child get a synthesized class.
    synthesizes_classes: bool
    #: The ``RemoteBackend`` method every status update from the server passes through.
    status_callback: str

    def output_attr(self, envoy, name: str = "output") -> str:
        """The attribute of ``envoy`` that is nnsight's ``name`` (its forward output)."""
        return self.served_attr(name) if self.collides(envoy, name) else name

    def served_attr(self, name: str = "output") -> str:
        """The attribute under which nnsight serves ``name`` on an envoy whose submodule is called ``name``."""
        return name if self.nnsight_keeps_name else self.moved_prefix + name

    def child_attr(self, name: str = "output") -> str:
        """The attribute under which a submodule called ``name`` is reachable."""
        return self.moved_prefix + name if self.nnsight_keeps_name else name

    def collides(self, envoy, name: str = "output") -> bool:
        """Whether ``envoy`` has a submodule called ``name``."""
        return name in dict(envoy._module.named_children())

    def seed_hub_ids(self, ids: dict) -> None:
        """Let model keys be minted offline: nnsight asks the hub to canonicalize repo ids."""
        import nnsight.modeling.huggingface as huggingface

        getattr(huggingface, self.id_cache).update(ids)

    def wrap(self, path, entry, tokenizer, dispatch: bool = True):
        """The path-based wrapper a user would build for ``entry`` on this line."""
        if self.wrapper == "LanguageModel":
            import transformers
            from nnsight import LanguageModel

            return LanguageModel(str(path), tokenizer=tokenizer, dispatch=dispatch,
                                 automodel=getattr(transformers, entry.automodel))
        from nnsight.modeling.transformers import TransformersModel

        return TransformersModel(str(path), task=entry.task, tokenizer=tokenizer, dispatch=dispatch)


LINES = {
    "0.7": Line("0.7", moved_prefix="nns_", nnsight_keeps_name=False, wrapper="LanguageModel",
                class_field="automodel", id_cache="ID_CACHE", synthesizes_classes=True,
                status_callback="handle_response"),
    "0.8": Line("0.8", moved_prefix="E_", nnsight_keeps_name=True, wrapper="TransformersModel",
                class_field="task", id_cache="_ID_CACHE", synthesizes_classes=False,
                status_callback="note"),
}


def line_of(version: str) -> Line:
    major_minor = ".".join(version.split(".")[:2])
    try:
        return LINES[major_minor]
    except KeyError:
        raise ValueError(
            f"nnsight {version} is not a supported line; supported: {', '.join(LINES)}."
        ) from None


def current() -> Line:
    """The line of the nnsight this interpreter imports."""
    from importlib.metadata import version

    return line_of(version("nnsight"))
