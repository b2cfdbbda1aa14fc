"""fmeg.testing's strategies draw what fmeg runs: every drawn layout of a drawn model trains, on
thread ranks, on one rank's curve (fmeg.testing.curves), with documents and padding drawn too."""

from hypothesis import given, settings
from hypothesis import strategies as st

from fmeg.parallel.layout import Layout
from fmeg.testing.curves import assert_same_curve, layout_curve_on, world_of
from fmeg.testing.strategies import KINDS, batches, gpt_configs, layouts


@settings(max_examples=10, deadline=None)
@given(data=st.data(), kind=st.sampled_from(KINDS), world=st.sampled_from([2, 4]))
def test_a_drawn_layout_trains_on_one_ranks_curve(data, kind, world):
    config = data.draw(gpt_configs(kinds=(kind,)))
    layout = data.draw(layouts(config, world))
    assert world_of(layout) == world
    # every data-parallel rank gets enough microbatches for its pipeline schedule
    count = layout.dp * layout.pp * data.draw(st.integers(1, 2))
    documents, padding = data.draw(st.booleans()), data.draw(st.booleans())
    microbatches = [
        data.draw(batches(config, rows=1, documents=documents, padding=padding))
        for _ in range(count)
    ]
    want = layout_curve_on(Layout(), config, microbatches, iterations=2)
    got = layout_curve_on(layout, config, microbatches, iterations=2)
    assert_same_curve(got, want)
