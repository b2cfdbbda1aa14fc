"""SOAP's own sensitivity, on one rank: a gradient that differs in its last bit (what another
layout's reduction order gives) moves SOAP's weights far more than it moves Adam's, because Adam's
division in the nearly singular factors' eigenbasis turns the tiny components along their near-null
directions into whole steps. This is why SOAP's curves across layouts agree within a band
(tests/layouts/test_optimizer_layouts.py) rather than to 1e-5."""

import torch

from fmeg import optim


def drift(opt, steps=20):
    gen = torch.Generator().manual_seed(0)
    params = {"w": torch.randn(16, 8, generator=gen)}
    grads = [{"w": torch.randn(16, 8, generator=gen) * 1e-2} for _ in range(steps)]
    ends = []
    for ulp in (0.0, 1.0):
        p, state = dict(params), opt.init(params)
        for g in grads:
            nudged = {"w": torch.nextafter(g["w"], torch.full_like(g["w"], 1.0))} if ulp else g
            updates, state = opt.update(nudged, state, p, lr=1e-2, weight_decay=0.0)
            p = optim.apply_updates(p, updates)
        ends.append(p["w"])
    return ((ends[0] - ends[1]).abs().max() / ends[0].abs().max()).item()


def test_a_last_bit_of_the_gradient_moves_soap_far_more_than_adam():
    soap, adam = drift(optim.soap()), drift(optim.adamw())
    assert adam < 1e-6 and soap > 1e3 * adam, (soap, adam)
