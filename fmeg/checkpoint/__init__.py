"""Checkpoints as placements: boxes of global tensors, written once, read where they overlap what a
rank holds.

    DIR/iter_0000010/rank_00003.safetensors
        this rank's cells: each a box of a global tensor, named by it
                                              ("mu/layers.0.mlp.fc1.weight[64:72,0:32]"); any
                                                  safetensors
                                              reader opens the file
    DIR/iter_0000010/rank_00003.json
        this rank's pieces: global name, global shape, dtype, box, how
                                              the box is cut into cells, the cells written and their
                                                  crc32s
    DIR/iter_0000010/metadata.json
        format 2, layout, model config, iteration, consumed samples (the
                                              sampler's and the schedules' position), loss scale,
                                                  arguments,
                                              and every rank's pieces (written last)
    DIR/latest_checkpointed_iteration.txt     the newest complete checkpoint (moved last)

Names are "<kind>/<global path>": params (the weights in the run's compute dtype), main (fp32 master
weights, in mixed precision), mu and nu (Adam's moments), and adam/count. Nothing here knows the
model: the training state lists its placements (fmeg.training.checkpoint_state), pieces are written
(save.write_rank), and a rank of any later layout reads the boxes it holds (load.Checkpoint.read),
taking from each file only the cells that overlap them, each checked by its crc32. Writes go to a
temporary directory renamed into place once complete (directory.py); a background writer
(background.BackgroundWriter) does the writing while training goes on. There is no RNG state to
save: dropout and data order are functions of (seed, iteration, sample index). Nothing is ever
unpickled.
"""

from fmeg.checkpoint.background import BackgroundWriter
from fmeg.checkpoint.boxes import Box, cell_bytes_for, cell_steps, flat_boxes
from fmeg.checkpoint.directory import (
    LATEST,
    METADATA,
    CheckpointError,
    disk_bytes,
    finalize,
    iteration_dir,
    latest,
    prune,
    remove_stale,
    temporary_dir,
)
from fmeg.checkpoint.load import Checkpoint, Request
from fmeg.checkpoint.save import Piece, write_rank

__all__ = [
    "BackgroundWriter",
    "Box",
    "Checkpoint",
    "CheckpointError",
    "LATEST",
    "METADATA",
    "Piece",
    "Request",
    "cell_bytes_for",
    "cell_steps",
    "disk_bytes",
    "finalize",
    "flat_boxes",
    "iteration_dir",
    "latest",
    "prune",
    "remove_stale",
    "temporary_dir",
    "write_rank",
]
