"""The model side. Only this package imports torch; oneDNN's primitive caches are capped here,
before any of it runs (`onednn_caches`)."""

from .runners.onednn_caches import bound as _bound_onednn_caches

_bound_onednn_caches()
