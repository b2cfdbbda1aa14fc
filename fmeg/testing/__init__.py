"""Property-testing sharded code against its unsharded reference, for anyone's code:

- check_sharded: a sharded function against its reference (forward, grad, vjp, vmap on thread
  ranks; jvp on gloo processes), with what differed in the failure;
- layout_curve_on / assert_same_curve: a model's training curve at a layout, in one process;
- check_run: a run's own flags at each layout against one rank, through the real runner (what
  python -m fmeg.check prints);
- fmeg.testing.strategies: hypothesis strategies for model configurations, layouts valid for
  them and batches (documents, padding); it needs hypothesis (the `test` extra).
"""

from fmeg.testing.check import Checked, ShardingMismatch, check_sharded, close_pools
from fmeg.testing.curves import assert_same_curve, layout_curve, layout_curve_on
from fmeg.testing.run_check import RowResult, check_run

__all__ = [
    "Checked",
    "RowResult",
    "ShardingMismatch",
    "assert_same_curve",
    "check_run",
    "check_sharded",
    "close_pools",
    "layout_curve",
    "layout_curve_on",
]
