"""``Lender``: a lent tensor is held from C++ (its use count one above its Python object's own) for
as long as the library holds it, and let go once the library has (docs/DESIGN.md#clean-exit). A
``torch.ScriptList`` stands in for the library's C++ reference."""

import torch

from grace_legacy.runtime.lending import Lender


def test_a_lent_tensor_is_held_until_the_library_lets_go():
    lender, tensor = Lender(), torch.zeros(3)
    assert tensor._use_count() == 1
    lender.lend([tensor])
    library = torch.ScriptList([tensor])  # the library takes it
    assert tensor._use_count() == 3
    lender.release_returned()
    assert len(lender) == 1 and tensor._use_count() == 3
    del library  # the library's release: 3 -> 2, never the Python object's last C++ partner
    assert tensor._use_count() == 2
    lender.release_returned()
    assert len(lender) == 0 and tensor._use_count() == 1


def test_a_set_is_held_while_the_library_holds_any_of_it_and_lending_lets_go_of_returned_sets():
    lender = Lender()
    a, b, c = torch.zeros(1), torch.zeros(2), torch.zeros(3)
    lender.lend([a, b])
    library = torch.ScriptList([b])  # a was not taken, or is already back
    lender.lend([c])
    in_flight = torch.ScriptList([c])
    assert len(lender) == 2
    del library
    lender.lend([])  # any lend lets go of what is back
    assert len(lender) == 1 and (a._use_count(), b._use_count(), c._use_count()) == (1, 1, 3)
    del in_flight


def test_tensors_the_library_already_took_count_from_this_holds_and_their_python_object():
    lender, output = Lender(), torch.zeros(3)
    library = torch.ScriptList([output])  # made and taken by the library's own wrapper
    lender.lend([output], taken=True)
    lender.release_returned()
    assert len(lender) == 1
    del library
    lender.release_returned()
    assert len(lender) == 0 and output._use_count() == 1


def test_other_holders_before_lending_are_not_waited_for():
    lender, tensor = Lender(), torch.zeros(3)
    elsewhere = torch.ScriptList([tensor])  # held in C++ by something else all along (a .grad, say)
    lender.lend([tensor])
    lender.release_returned()
    assert len(lender) == 0 and tensor._use_count() == 2
    del elsewhere
