"""The test suite. A package so that workers launched under horovodrun, torchrun or pytest import
the shared registry and helpers by one name (``tests.registry``, ``tests.helpers``)."""
