"""Pipeline schedules as data: generate, validate, simulate, draw and execute per-rank action
lists."""

from fmeg.parallel.pipeline.actions import Action, Schedule, format_schedule, parse_schedule
from fmeg.parallel.pipeline.schedules import (
    gpipe,
    interleaved_1f1b,
    one_f_one_b,
    with_communication,
    zero_bubble_h1,
)
from fmeg.parallel.pipeline.draw import draw_timeline
from fmeg.parallel.pipeline.simulate import Timeline, simulate, timeline_text
from fmeg.parallel.pipeline.validate import ScheduleError, validate

# the executor is the module execute (execute.execute runs a schedule): its name stays the module's
__all__ = [
    "Action",
    "Schedule",
    "ScheduleError",
    "Timeline",
    "draw_timeline",
    "format_schedule",
    "gpipe",
    "interleaved_1f1b",
    "one_f_one_b",
    "parse_schedule",
    "simulate",
    "timeline_text",
    "validate",
    "with_communication",
    "zero_bubble_h1",
]
