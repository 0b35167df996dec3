"""Test and demo instruments shipped with the appliance (fakes are real classes).

Nothing in production imports this package; tests and `make demo` pass its doubles in
through `build_runtime(...)`.
"""
