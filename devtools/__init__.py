"""Machinery shared by the tests, the benchmarks and the CI, never installed (``setup.py`` packages
``vescale_zero`` only): exact live tensor bytes (``live_bytes``), two hosts in network namespaces
(``netns``, needs root) and megatron-core on CPU (``megatron_shim``). Run from the repository's root."""
