"""Character-level pet-name language model: vocabulary, corpus loading and formatting."""
