"""Helpers the tests share: what a test calls, not fixtures (those stay in each folder's conftest).
No test imports another test's module or conftest."""
