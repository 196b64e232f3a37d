"""Backends: the collective libraries communicators talk to. Import one explicitly, e.g.
``from grace_legacy.backends.horovod import HorovodBackend``; none is imported here so that
compressors and memories can be used without any collective library installed."""
