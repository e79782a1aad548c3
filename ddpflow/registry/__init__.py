"""The model registry: registration, reading without running code, loading a registered
model with its digest checked and pickle refused, promotion."""
