"""Where a training stands, from rank 0 to the flow process."""
