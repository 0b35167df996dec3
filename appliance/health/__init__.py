"""Health checks and monitoring: GPU, engine and host checks feeding one monitor.

`model` holds the shared frozen values (levels, check results, snapshots, sample names);
the check modules are pure functions over readings; adapters read NVML, the engine and the
host; the monitor schedules them, keeps the latest snapshot, records transitions and
history, and sends alerts.
"""
