"""Models: configs plus pure init/apply functions."""
