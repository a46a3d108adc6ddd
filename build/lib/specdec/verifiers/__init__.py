"""Verifiers, one module each: the implementations of
:class:`specdec.decoders.engine.verifier.Verifier`. Nothing is imported here; the engine's
registry imports a built-in the first time its name is looked up
(:data:`specdec.decoders.engine.registry.BUILTIN_VERIFIERS`)."""
