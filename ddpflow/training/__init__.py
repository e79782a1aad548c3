"""Training on a TrainContext: settings, the context, the loop, progress, speed."""
