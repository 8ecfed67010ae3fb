"""raywright cluster: the launcher config, its local twin and the job CLI."""
