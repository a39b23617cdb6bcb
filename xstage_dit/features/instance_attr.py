"""`set_on_instance(owner, name, value)`: put an attribute on one object and get back the undo.

Why one helper: patches replace callables on single objects (a module's ``forward``, a pipeline's
``encode_prompt``, a VAE's ``decode``) and must leave the object as they found it. Two things make that easy to
get wrong, and each copy of the pattern got one of them wrong once: an instance may already hold an attribute of
its own (a diffusers hook's ``forward``, another patch's wrapper), which must come back rather than be deleted;
and where there was none, the undo must delete the instance's attribute so the class's shows through again
(setting the class's function back on the instance would pin it there).

    undo = set_on_instance(module, "forward", wrapped)
    ...
    undo()    # module.forward is what it was: its own earlier attribute, or the class's method

``keep_instance_attr(owner, name)`` is the putting back alone, for attributes that other code replaces.
``remove_hook(module, name)`` removes a diffusers hook the same way: once the module's last hook is gone, its
empty registry and the bound ``forward`` diffusers leaves on the instance go too.
"""

from __future__ import annotations

from typing import Any, Callable

__all__ = ["keep_instance_attr", "remove_hook", "set_on_instance"]

_NONE_OF_ITS_OWN = object()


def keep_instance_attr(owner: Any, name: str) -> Callable[[], None]:
    """Remember ``owner``'s own ``<name>`` as it is now; returns the function that puts it back: the attribute
    the instance held, or none of its own (the class's shows through) where it held none. For code that lets
    someone else replace the attribute (xfuser's compile sets a ``forward`` on the transformer)."""
    previous = vars(owner).get(name, _NONE_OF_ITS_OWN)

    def restore() -> None:
        if previous is not _NONE_OF_ITS_OWN:
            setattr(owner, name, previous)
        elif name in vars(owner):
            delattr(owner, name)

    return restore


def set_on_instance(owner: Any, name: str, value: Any) -> Callable[[], None]:
    """``owner.<name> = value`` on the instance; returns the undo (idempotent).

    The undo puts back the attribute the instance held before, or deletes the instance's attribute where it had
    none. It does nothing where ``owner.<name>`` is no longer ``value`` (someone set it since: a user's own
    replacement, or a later patch whose undo has not run), so an undo never clobbers what came after it."""
    restore = keep_instance_attr(owner, name)
    setattr(owner, name, value)

    def undo() -> None:
        if vars(owner).get(name, _NONE_OF_ITS_OWN) is value:
            restore()

    return undo


def remove_hook(module: Any, name: str) -> None:
    """Remove the diffusers hook `name` from `module` (not its children; nothing where it has none). When it was
    the module's last hook, the empty ``_diffusers_hook`` registry is dropped, and so is the ``forward`` diffusers
    leaves on the instance when it is the class's own method bound to the module (the class's shows through
    again); a ``forward`` the module held of its own before stays."""
    registry = vars(module).get("_diffusers_hook")
    if registry is None:
        return
    registry.remove_hook(name, recurse=False)
    if registry.hooks:
        return
    forward = vars(module).get("forward")
    if getattr(forward, "__self__", None) is module and getattr(forward, "__func__", None) is type(module).forward:
        del vars(module)["forward"]
    del vars(module)["_diffusers_hook"]
