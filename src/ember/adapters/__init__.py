"""Model families: each module turns prepared items into one forward of one kind of model."""
