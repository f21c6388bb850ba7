"""`fastmamba serve`: the OpenAI-compatible HTTP front end, its options and metrics, the
process main with its drain, and the Ray Serve deployment."""
