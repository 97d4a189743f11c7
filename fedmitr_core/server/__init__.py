"""The server's side: upload intake, the teacher ensemble, the pipeline, crash-safe state."""
