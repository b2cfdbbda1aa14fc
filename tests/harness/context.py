"""Context parallelism's checks: each rank holds its rows of the one-device result, and the
ranks' gradients sum to the one-device gradient."""

import torch
from fmeg import tree
from fmeg.models import gpt
from fmeg.parallel import context
from fmeg.parallel.sharding import shard


def assert_each_rank_holds_its_rows(results, want, want_grads, doubled):
    """Each cp rank's out and gradients (spmd_programs.context_attention) are its rows of one
    device's; its vmap over (q, 2 q) too, where doubled() gives one device's attention of 2 q (None
    with dropout)."""
    world, seq = len(results), want.shape[-2]
    twice = doubled()
    for r, got in enumerate(results):
        # rank r's rows
        mine = lambda t: t.index_select(-2, context.positions(seq, world, r))
        torch.testing.assert_close(got["out"], mine(want), rtol=1e-10, atol=1e-10)
        for g, w in zip(got["grads"], want_grads):
            torch.testing.assert_close(g, mine(w), rtol=1e-10, atol=1e-10)
        if twice is not None:
            torch.testing.assert_close(
                got["vmap"], mine(torch.stack([want, twice])), rtol=1e-10, atol=1e-10
            )


def assert_cp_ranks_sum_to_one_device(results, want_loss, want_grads, tp):
    """For each tp rank: its cp ranks' losses and gradients (results: (loss, grads, (tp, cp)
    coordinates, ...) per rank) sum to one device's loss and to the tp shard of its gradients."""
    for t in range(tp):
        ranks = [r for r in results if r[2][0] == t]
        torch.testing.assert_close(sum(r[0] for r in ranks), want_loss, rtol=1e-10, atol=1e-12)
        summed = {
            path: sum(tree.flatten(r[1])[path] for r in ranks) for path in tree.flatten(ranks[0][1])
        }
        want = tree.flatten(shard(want_grads, gpt.TP_RULES, {"tp": (t, tp)}))
        for path, g in summed.items():
            torch.testing.assert_close(g, want[path], rtol=1e-9, atol=1e-11, msg=path)
