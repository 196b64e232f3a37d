"""Backends: the collective libraries communicators talk to. Import one explicitly
(``grace_legacy.backends.horovod``); none is imported here, so grace_legacy needs none installed."""
