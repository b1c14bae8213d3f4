"""qmigrate: request migration across a fleet of GPU workers."""

__version__ = "0.1.0"
