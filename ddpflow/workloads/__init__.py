"""The built-in workloads: the char-LM, images, sweeps and scaling runs."""
