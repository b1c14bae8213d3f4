"""qmigrate: request migration across a fleet of GPU workers.

`from qmigrate import LLM, SamplingParams` is the offline API (qmigrate/offline/); it is
imported on first use, so `import qmigrate` alone does not load torch."""

__version__ = "0.1.0"

_OFFLINE = {"LLM": "qmigrate.offline.llm", "SamplingParams": "qmigrate.offline.params",
            "RequestOutput": "qmigrate.offline.params", "CompletionOutput": "qmigrate.offline.params"}
__all__ = ["__version__", *_OFFLINE]


def __getattr__(name: str):
    if name in _OFFLINE:
        import importlib
        return getattr(importlib.import_module(_OFFLINE[name]), name)
    raise AttributeError(f"module 'qmigrate' has no attribute {name!r}")
