"""`set_on_instance`: the undo puts back what the instance held, and never what came after it."""

import torch

from xstage_dit.features.instance_attr import set_on_instance


def _doubled(x):
    return 2 * x


def _tripled(x):
    return 3 * x


def test_undo_deletes_the_attribute_so_the_class_method_shows_again():
    linear = torch.nn.Linear(3, 3)
    undo = set_on_instance(linear, "forward", _doubled)
    assert linear.forward is _doubled
    undo()
    assert "forward" not in vars(linear)
    assert linear.forward.__func__ is torch.nn.Linear.forward
    undo()  # idempotent
    assert "forward" not in vars(linear)


def test_undo_puts_back_an_attribute_of_the_instances_own():
    linear = torch.nn.Linear(3, 3)
    linear.forward = _tripled  # a hook's forward, or another patch's
    undo = set_on_instance(linear, "forward", _doubled)
    undo()
    assert vars(linear)["forward"] is _tripled


def test_nested_patches_undone_in_reverse_order_leave_the_object_as_found():
    class Pipe:
        def encode_prompt(self):
            return "own"

    pipe = Pipe()
    undos = [set_on_instance(pipe, "encode_prompt", _doubled), set_on_instance(pipe, "encode_prompt", _tripled)]
    assert pipe.encode_prompt is _tripled
    for undo in reversed(undos):
        undo()
    assert "encode_prompt" not in vars(pipe) and pipe.encode_prompt() == "own"


def test_undo_leaves_alone_what_was_set_after_it():
    class Pipe:
        pass

    pipe = Pipe()
    undo = set_on_instance(pipe, "encode_prompt", _doubled)
    pipe.encode_prompt = _tripled  # the user's own replacement, after the patch
    undo()
    assert pipe.encode_prompt is _tripled
