"""The model registry: registration, reading without running code, promotion."""
