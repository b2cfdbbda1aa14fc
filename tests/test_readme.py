"""The README's example runs as written."""

import re
from pathlib import Path


def test_readme_python_example_runs():
    text = (Path(__file__).parents[1] / "README.md").read_text()
    code = re.search(r"```python\n(.*?)```", text, re.S).group(1)
    namespace: dict = {}
    exec(compile(code, "README.md", "exec"), namespace)
    assert namespace["logits"].shape == (4, 64, 256)
    assert 5.0 < namespace["metrics"]["loss"].item() < 6.0
