"""Where the residuals live: the checkpoint policy, placement inspection, the planner and its measurements."""
