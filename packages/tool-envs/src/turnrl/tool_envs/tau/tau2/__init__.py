"""tau2-bench environments: airline, retail and telecom (dual control), scored as tau2 does."""
