"""Pipeline schedules as data: generate, validate, simulate, draw and execute per-rank action lists."""

from fmeg.parallel.pipeline.actions import Action, Schedule, format_schedule, parse_schedule
from fmeg.parallel.pipeline.schedules import (gpipe, interleaved_1f1b, one_f_one_b, with_communication,
                                              zero_bubble_h1)
from fmeg.parallel.pipeline.simulate import Timeline, simulate
from fmeg.parallel.pipeline.validate import ScheduleError, validate

__all__ = ["Action", "Schedule", "ScheduleError", "Timeline", "format_schedule", "gpipe", "interleaved_1f1b",
           "one_f_one_b", "parse_schedule", "simulate", "validate", "with_communication", "zero_bubble_h1"]
