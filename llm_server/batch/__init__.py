"""The OpenAI Batch API: files and batches kept under --data-dir, run at lowest priority."""
