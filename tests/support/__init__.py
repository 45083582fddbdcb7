"""Helpers shared by the tests (imported by test modules and conftest alike)."""
