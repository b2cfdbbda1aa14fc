"""Pipeline schedules as data: generate, validate, simulate, draw and execute per-rank action
lists."""

from fmeg.parallel.pipeline.actions import (
    Action,
    Placement,
    Schedule,
    format_schedule,
    looped,
    parse_schedule,
    placement_of,
    v_shape,
)
from fmeg.parallel.pipeline.schedules import (
    dualpipe_v,
    gpipe,
    interleaved_1f1b,
    one_f_one_b,
    with_communication,
    zero_bubble_h1,
    zero_bubble_v,
)
from fmeg.parallel.pipeline.draw import draw_timeline
from fmeg.parallel.pipeline.simulate import Timeline, simulate, timeline_text
from fmeg.parallel.pipeline.validate import ScheduleError, validate

# the executor is the module execute (execute.execute runs a schedule): its name stays the module's
__all__ = [
    "Action",
    "Placement",
    "Schedule",
    "ScheduleError",
    "Timeline",
    "draw_timeline",
    "dualpipe_v",
    "format_schedule",
    "gpipe",
    "interleaved_1f1b",
    "looped",
    "one_f_one_b",
    "parse_schedule",
    "placement_of",
    "simulate",
    "timeline_text",
    "v_shape",
    "validate",
    "with_communication",
    "zero_bubble_h1",
    "zero_bubble_v",
]
