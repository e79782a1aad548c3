"""Pre-flight: every component proven to work before expensive or stateful work."""
