"""LiveBytes counts each live storage once, for as long as it lives, and its peak: checked on a
known allocation pattern whose bytes are counted here by hand."""

import torch

from meshfold.runtime.live_bytes import LiveBytes

MIB = 1 << 20


def test_live_bytes_follow_a_known_pattern_through_views_frees_resizes_and_backward():
    live = LiveBytes()
    w = torch.zeros(256, 1024, requires_grad=True)  # 1 MiB, made before the mode: adopted
    live.adopt([w, w])
    assert (live.now, live.peak) == (MIB, MIB)
    resize = torch.UntypedStorage.resize_
    with live:
        a = torch.empty(2 * MIB, dtype=torch.uint8)
        a.view(2, -1)[1].add_(1)  # a view and an in-place op: no new storage
        torch.add(a, 1, out=a)
        assert live.now == 3 * MIB
        b = a.clone()
        del a
        assert (live.now, live.peak) == (3 * MIB, 5 * MIB)
        del b
        s = torch.empty(0).untyped_storage()
        s.resize_(4 * MIB)  # as FSDP2 regrows a weight: no op shows it
        assert (live.now, live.peak) == (5 * MIB, 5 * MIB)
        s.resize_(0)
        assert live.now == MIB
        x = torch.ones(64, 256)  # 64 KiB
        (x @ w).sum().backward()  # w.grad: 1 MiB, made in backward
        assert w.grad is not None and live.now == 2 * MIB + 64 * 1024
    assert torch.UntypedStorage.resize_ is resize and "resize_" not in vars(torch.UntypedStorage)
    live.reset_peak()
    assert live.peak == live.now
    del x, w
    assert live.now == 0

