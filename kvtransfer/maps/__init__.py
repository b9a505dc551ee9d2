"""Map kinds beyond the paper's closed-form ridge: families (head-local, reduced rank, attention metric),
the MLP, and the paper's map trained layer-locally or end to end. Built on kvtransfer.core."""
