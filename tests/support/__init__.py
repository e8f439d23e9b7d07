"""The one support layer of the test suite: lock servers, processes, services, waiting,
ports, TLS certificates, the Celery app factory (apps), Celery workers and beats, the rig of the
worker tests (rigs), a TCP proxy that misbehaves on demand.
Every test directory imports it as ``tests.support.<module>``; nothing here is a test or a
fixture (fixtures live in the conftest.py files and build on these modules)."""
