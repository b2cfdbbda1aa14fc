"""Megatron-LM's checkpoints: a torch_dist checkpoint (PyTorch's distributed checkpoint, as Megatron
writes it by default) read into fmeg at any layout.

    iter_0000100/.metadata
        every tensor's global shape and its chunks (a pickle: safe_pickle.py)
    iter_0000100/__R_K.distcp       the chunks, each a torch.save'd tensor (torch_dist.py)
    iter_0000100/common.pt          args, iteration, ... (a torch.save'd dict: safe_pickle.py)
    iter_0000100/metadata.json      {"sharded_backend": "torch_dist", ...}

gpt_keys.py names fmeg's GPT parameters as megatron-core's GPTModel does; checkpoint.py opens such a
directory as fmeg's resume opens its own checkpoints; model_args.py reads and writes the model in
Megatron's args; export.py writes fmeg's weights as such a directory (optimizer_state.py, Adam's
state); legacy.py reads the legacy --ckpt-format torch files (mp_rank_*/model_optim_rng.pt) as the
same global tensors.
"""

from fmeg.interop.megatron.checkpoint import (
    MegatronCheckpoint,
    is_megatron,
    is_torch_dist,
    saved_args,
)
from fmeg.interop.megatron.safe_pickle import MegatronCheckpointError

__all__ = [
    "MegatronCheckpoint",
    "MegatronCheckpointError",
    "is_megatron",
    "is_torch_dist",
    "saved_args",
]
