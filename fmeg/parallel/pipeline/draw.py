"""A schedule's timeline as a picture (matplotlib, an optional extra: pip install fmeg[plot])."""

from __future__ import annotations

from pathlib import Path

from fmeg.parallel.pipeline.simulate import Timeline

COLOURS = {"F": "#4C72B0", "B": "#DD8452", "W": "#55A868"}


def draw_timeline(timeline: Timeline, path: str | Path, title: str = "") -> Path:
    """Write a PNG with one row per rank and one box per compute action, labelled with its
    microbatch."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ranks = len(timeline.events)
    fig, ax = plt.subplots(figsize=(max(6.0, timeline.total * 0.35), 0.6 * ranks + 1.2))
    for r, events in enumerate(timeline.events):
        for action, start, end in events:
            if not action.is_compute:
                continue
            ax.barh(r, end - start, left=start, color=COLOURS[action.kind], edgecolor="white")
            ax.text(
                (start + end) / 2,
                r,
                str(action.microbatch),
                ha="center",
                va="center",
                fontsize=7,
                color="white",
            )
    ax.set_yticks(range(ranks), [f"rank {r}" for r in range(ranks)])
    ax.invert_yaxis()
    ax.set_xlabel("time")
    ax.set_title(f"{title}  bubble {timeline.bubble_fraction:.3f}".strip())
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in COLOURS.values()]
    ax.legend(handles, COLOURS.keys(), loc="upper right", fontsize=7)
    fig.tight_layout()
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp.png")
    fig.savefig(tmp, dpi=100)
    plt.close(fig)
    # never leave a half-written picture
    tmp.replace(path)
    return path
