"""Training speed: what a user asks (torch-free) and what runs on a device."""
