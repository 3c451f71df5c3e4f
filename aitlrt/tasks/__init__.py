"""Tasks: loading, repository sources, test environments, grading and offline generation."""
