"""raywright serve: the trained model behind an HTTP endpoint."""
