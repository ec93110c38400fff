"""Integrations with training frameworks, one module each, imported on demand (each
needs its framework installed): :mod:`.hf` for ``transformers.Trainer``."""
