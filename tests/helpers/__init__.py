"""Code the tests share (no tests here): the small CPU config, the FSDP and faults harnesses, model stand-ins,
verl's reference functions, and the builders several test files use. Import as `from helpers.<module> import ...`
(pyproject's pytest `pythonpath` puts tests/ on the path). Fixtures live in the conftest.py files."""
