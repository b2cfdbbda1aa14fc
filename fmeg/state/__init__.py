"""A rank's persistent training state in flat buffers allocated once, and the protocol it
implements."""

from fmeg.state.experts import ExpertSplitState, is_expert, split_experts
from fmeg.state.flat import SHARDINGS, FlatState, unit_of
from fmeg.state.protocol import Parts, TrainingState

__all__ = [
    "SHARDINGS",
    "ExpertSplitState",
    "FlatState",
    "Parts",
    "TrainingState",
    "is_expert",
    "split_experts",
    "unit_of",
]
