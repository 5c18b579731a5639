"""The Celery task API: thin tasks over `vmmgr`, a Redis broker, one worker per host."""
