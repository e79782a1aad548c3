"""Image classification by transfer learning: image folder, split, ResNet, training, reports."""
