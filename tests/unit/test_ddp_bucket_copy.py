"""How the DDP hook writes a bucket's results back into DDP's bucket (``grace_legacy/ddp.py``)."""

import torch


def test_results_that_lie_back_to_back_are_copied_into_the_bucket_as_one():
    """The hook copies a bucket's results with one copy only when they are consecutive pieces of
    one tensor, in the bucket's order, filling it exactly."""
    from grace_legacy.ddp import _back_to_back

    flat = torch.arange(12.0)
    pieces = [flat[0:3].view(3, 1), flat[3:10], flat[10:12]]
    whole = _back_to_back(pieces, 12)
    assert whole is not None and torch.equal(whole, flat)
    assert whole.data_ptr() == flat.data_ptr()
    assert _back_to_back(pieces, 13) is None  # the bucket holds more
    assert _back_to_back([pieces[1], pieces[0], pieces[2]], 12) is None  # out of order
    assert _back_to_back([flat[0:3], flat[4:12]], 11) is None  # a gap
    assert _back_to_back([flat[0:3], torch.arange(3.0, 12.0)], 12) is None  # another tensor
    assert _back_to_back([flat[0:3], flat[3:12].double()], 12) is None  # another dtype
    strided = torch.arange(24.0)[::2]
    assert _back_to_back([strided[:6], strided[6:]], 12) is None  # not contiguous
