"""The worker role: loop.py runs leases on one device, around the pure pipeline (what to ask for, what to start) and core (a lease on the engine)."""
