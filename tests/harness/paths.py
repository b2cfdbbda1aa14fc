"""Where things are, for tests at any depth of tests/."""

from pathlib import Path

TESTS = Path(__file__).resolve().parent.parent
ROOT = TESTS.parent
FIXTURES = TESTS / "fixtures"
