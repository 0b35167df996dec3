"""Admission measured, not guessed: qualify the box, then admit at the point that holds every
user's floor.

`plan` (pure: the ladder, the workloads, a duration estimate), `verdict` (pure: per-step
statistics and the qualified-point rule), `runner` (the load against the local engine),
`ledger` (every qualification, per launch-spec hash) and `service` (one qualification at a
time, off the request path, with the gateway closed meanwhile). The gateway reads only the
closing flag on the engine status row and, later, the running spec's qualified point.
"""
