"""Integrations with other libraries (import the submodule you need, e.g.
:mod:`ferroattn.integrations.transformers`)."""
