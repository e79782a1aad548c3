"""The embedded MLflow store (SQLite): creation and the installed template."""
